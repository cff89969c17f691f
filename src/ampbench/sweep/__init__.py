"""The batch-size sweep: how throughput and memory grow with the batch, per precision, and the largest that fits.

    python stages/sweep.py --params params.yaml --data data/prepared --env reports/env.json --out reports/sweep

Each point is a short timed run, not a training: ``sweep.steps`` optimizer
steps of the engine's own step (``step.train_step``) after ``WARMUP`` untimed
ones, on a fresh model, with a batch drawn from the prepared set and the
run's augmentation. It measures end-to-end img/s with its spread (data,
compute and host work, the device synchronised), peak memory (CUDA peak
allocated and reserved; on a CPU the bytes autograd saves for backward) and
TFLOP/s. A point is stored with a key of everything it depends on, so a
changed ``sweep.batch_sizes`` measures only the new points.

The largest batch per precision: on CUDA, doubling from the largest swept
batch that fit until ``torch.cuda.OutOfMemoryError``, then bisection, freeing
the failed attempt's memory before the next (the process stays usable);
``sweep.memory_limit_gib`` caps the memory the process may use. On a CPU,
where nothing runs out, an estimate from the measured bytes per image and the
fixed bytes (parameters, gradients, optimizer state, the data set) against
the limit (or this machine's memory), labelled as an estimate.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from ampbench import models, runplan
from ampbench.config import Config, sweep_precisions, to_dict
from ampbench.errors import analysis
from ampbench.precision import rung
from ampbench.results import SWEEP_COLUMNS, atomic_write, csv_text, source_digest, source_files, write_json
from ampbench.sweep.bench import POOL, WARMUP, Bench  # noqa: F401
from ampbench.sweep.search import (  # noqa: F401
    SearchStopped,
    cap_memory,
    find_max,
    fits,
    largest_batch,
    limit_bytes,
    out_of_memory,
    search_max,
)


def code_digest() -> str:
    """A hash of the source of every ampbench module this one reaches (the model registry and built-in models,
    the step, the precision policy, the data feed, the meters): editing any of them remeasures every point,
    editing anything else (the report, tracking) does not."""
    return source_digest(source_files(Path(__file__)) + [Path(__file__).resolve()])  # bench and search too


def point_key(cfg: Config, precision: str, batch: int, meta: dict, env_fingerprint: str, model_source: dict,
              code: str, compiled: bool = False) -> str:
    """A hash of everything one point's numbers depend on: its settings, the data, the machine, the model's
    source (a user's factory; torchvision's version for a tv: model) and this code (``code_digest``)."""
    parts = {"precision": precision, "batch": batch, "steps": cfg.sweep.steps, "seed": cfg.seed,
             "model": to_dict(cfg.model), "augment": cfg.train.augment,
             "amp": to_dict(cfg.amp) if rung(precision).grad_scaler else None,  # the loss scale: fp16's alone
             "limit": cfg.sweep.memory_limit_gib, "data": meta,
             "optimizer": [cfg.train.optimizer, cfg.train.optimizer_impl, cfg.train.clip_grad_norm,
                           cfg.train.momentum, cfg.train.weight_decay],  # momentum 0: no buffer, less memory
             "env": env_fingerprint, "model_source": model_source, "code": code}
    if runplan.recipe(cfg, precision):  # a rung with recipes: the one it runs
        parts["recipe"] = runplan.recipe(cfg, precision)
    if compiled:  # an fp8 point compiled (train.compile auto, on CUDA) is not the same measurement as an eager one
        parts["compiled"] = True
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


class PointBudget:
    """On a CPU, where a sweep point's time grows with its batch into minutes (a ViT at batch 1024), the points
    ``sweep.cpu_point_budget_s`` leaves out: a batch is left out, with every larger one of its precision, once the
    last point's time per image says it would take longer than the budget. A GPU measures every point."""

    def __init__(self, cfg: Config, device: torch.device):
        self.budget = cfg.sweep.cpu_point_budget_s if device.type == "cpu" else 0.0
        self.last: tuple[int, float] | None = None  # (batch, seconds) of the last point with its time
        self.stopped: str | None = None

    def took(self, point: dict) -> None:
        if point.get("seconds") and not point.get("oom"):
            self.last = (point["batch_size"], point["seconds"])

    def over(self, batch: int) -> str | None:
        """Why ``batch`` is left out, or None to measure it."""
        if self.stopped or not self.budget or self.last is None:
            return self.stopped
        b, seconds = self.last
        expected = seconds * batch / b
        if expected > self.budget:
            self.stopped = (f"over sweep.cpu_point_budget_s = {self.budget:g} s on a CPU (batch {b} took "
                            f"{seconds:.1f} s: batch {batch} would take about {expected:.0f} s)")
        return self.stopped


def _measure(bench: Bench, batch: int, steps: int, key: str) -> dict:
    """One point, printed as it is measured; an out-of-memory batch is a point too, and a point that fails
    otherwise is one warning and a point with its ``error`` (not stored: it is tried again next time)."""
    t0 = time.perf_counter()

    def attempt() -> dict:
        try:
            return {**bench.point(batch, steps), "key": key}
        except RuntimeError as err:
            if not out_of_memory(err):
                raise
            bench.free()
            return {"precision": bench.precision, "batch_size": batch, "oom": True, "key": key}

    # any other error: no free(), the CUDA context may be unusable (as in the largest-batch search)
    point, why = analysis("sweep", f"{models.name(bench.cfg.model)} ({bench.precision}, batch {batch})", attempt)
    if why:
        return {"precision": bench.precision, "batch_size": batch, "error": why}
    point["seconds"] = round(time.perf_counter() - t0, 3)  # the point's own time: what the CPU budget reads
    mem = (f"peak {point.get('peak_mem_bytes', 0) / 2**20:,.0f} MiB" if bench.device.type == "cuda"
           else f"activations {point.get('activation_bytes', 0) / 2**20:,.1f} MiB")
    what = "out of memory" if point.get("oom") else f"{point['imgs_per_s']:,.0f} img/s, {mem}"
    print(f"[sweep {bench.precision}] batch {batch}: {what} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return point


def run_sweep(cfg: Config, prepared: dict, device: torch.device, out: Path, env_fingerprint: str,
              model_source: dict) -> dict:
    """Every point of ``sweep.batch_sizes`` x precisions (reused from ``out/points`` when its key is unchanged),
    the largest batch per precision; writes points/, max.json, sweep.csv and sweep.json under ``out``."""
    cap_memory(cfg, device)
    code = code_digest()
    points_dir = out / "points"
    wanted, rows, largest, reused = set(), [], {}, 0
    try:
        known_max = json.loads((out / "max.json").read_text())
    except (OSError, ValueError):
        known_max = {}
    precisions = sweep_precisions(cfg)
    failed = []  # points (and largest-batch searches) that could not be made, with why
    left_out = []  # points a CPU would take longer than sweep.cpu_point_budget_s over, with why
    compiles = {p: runplan.for_precision(cfg, p, device.type).train.compile for p in precisions}
    for precision in precisions:
        wanted.update(f"{precision}-{batch}.json" for batch in cfg.sweep.batch_sizes)  # kept, even if this fails
        bench, why = analysis("sweep", f"{models.name(cfg.model)} ({precision}: its setup)", Bench, cfg, prepared,
                              device, precision)
        if bench is None:
            failed += [{"precision": precision, "batch_size": b, "error": why} for b in cfg.sweep.batch_sizes]
            continue
        points, budget = [], PointBudget(cfg, device)
        compiled = compiles[precision]
        for batch in sorted(cfg.sweep.batch_sizes):
            path = points_dir / f"{precision}-{batch}.json"
            key = point_key(cfg, precision, batch, prepared["meta"], env_fingerprint, model_source, code, compiled)
            old = json.loads(path.read_text()) if path.is_file() else {}
            if old.get("key") == key:
                point, reused = old, reused + 1
            elif (why := budget.over(batch)) is not None:
                left_out.append({"precision": precision, "batch_size": batch, "why": why})
                print(f"[sweep {precision}] batch {batch}: left out, {why}", flush=True)
                continue
            else:
                point = _measure(bench, batch, cfg.sweep.steps, key)
                if point.get("error"):
                    failed.append(point)
                    continue
                write_json(path, point)
            points.append(point)
            budget.took(point)
            spread = point.get("imgs_per_s_p10_p90") or [None, None]
            rows.append({"variant": precision, **{k: point.get(k) for k in SWEEP_COLUMNS[1:] if k in point},
                         "imgs_per_s_p10": spread[0], "imgs_per_s_p90": spread[1], "oom": bool(point.get("oom"))})
        if cfg.sweep.find_max:  # reused while its inputs (and the points it starts from) are unchanged
            key = hashlib.sha256(json.dumps([point_key(cfg, precision, 0, prepared["meta"], env_fingerprint,
                                                       model_source, code, compiled), [p["key"] for p in points],
                                             limit_bytes(cfg, device)[0]]).encode()).hexdigest()[:16]
            before = known_max.get(precision) or {}
            if before.get("key") == key and before.get("method") not in ("stopped", "failed"):  # errors: again
                largest[precision], note = before, ", as measured before: its inputs are unchanged"
            else:
                found, why = analysis("largest_batch", f"{models.name(cfg.model)} ({precision})", find_max, bench,
                                      [p for p in points if not p.get("oom")], cfg, _dataset_bytes(prepared))
                found = found or {"precision": precision, "largest_batch": None, "method": "failed", "how": why}
                largest[precision], note = {**found, "key": key}, ""
            print(f"[sweep {precision}] largest batch: {largest[precision]['largest_batch']} "
                  f"({largest[precision]['method']}{note})", flush=True)
        del bench
    for stale in points_dir.glob("*.json"):
        if stale.name not in wanted:
            stale.unlink()
    result = {"enabled": True, "device": device.type, "precisions": list(precisions),
              "batch_sizes": list(cfg.sweep.batch_sizes), "steps": cfg.sweep.steps, "warmup": WARMUP, "points": rows,
              "largest": largest, "reused_points": reused, "measured_points": len(rows) - reused,
              "not_made": failed, "left_out": left_out,
              "eager": [p for p in precisions if rung(p).fast_compiled and not compiles[p]],  # in each point's key
              "cpu_point_budget_s": cfg.sweep.cpu_point_budget_s if device.type == "cpu" else None}
    write_json(out / "max.json", largest)
    atomic_write(out / "sweep.csv", csv_text(rows, SWEEP_COLUMNS))
    write_json(out / "sweep.json", result)
    return result


def _dataset_bytes(prepared: dict) -> int:
    """Bytes of the set in memory (a streamed folder's images are decoded per batch: its labels alone)."""
    return sum(t.nbytes for split in ("train", "test") for t in prepared[split])
