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

import gc
import hashlib
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from ampbench import models, runplan
from ampbench.config import Config, sweep_precisions, to_dict
from ampbench.data import DeviceBatches
from ampbench.errors import analysis
from ampbench.measure import clock, flops, memory, stats
from ampbench.results import SWEEP_COLUMNS, atomic_write, csv_text, source_digest, source_files, write_json
from ampbench.train import probes, setup, step

POOL = 2048  # images decoded once from a streamed folder, from which every point draws its batch
WARMUP = 2  # untimed steps before each point's timed ones (allocation, cuDNN autotuning)


def code_digest() -> str:
    """A hash of the source of every ampbench module this one reaches (the model registry and built-in models,
    the step, the precision policy, the data feed, the meters): editing any of them remeasures every point,
    editing anything else (the report, tracking) does not."""
    return source_digest(source_files(Path(__file__)) + [Path(__file__).resolve()])


def point_key(cfg: Config, precision: str, batch: int, meta: dict, env_fingerprint: str, model_source: dict,
              code: str) -> str:
    """A hash of everything one point's numbers depend on: its settings, the data, the machine, the model's
    source (a user's factory; torchvision's version for a tv: model) and this code (``code_digest``)."""
    parts = {"precision": precision, "batch": batch, "steps": cfg.sweep.steps, "seed": cfg.seed,
             "model": to_dict(cfg.model), "amp": to_dict(cfg.amp), "augment": cfg.train.augment,
             "limit": cfg.sweep.memory_limit_gib, "data": meta,
             "optimizer": [cfg.train.optimizer, cfg.train.optimizer_impl, cfg.train.clip_grad_norm,
                           cfg.train.momentum, cfg.train.weight_decay],  # momentum 0: no buffer, less memory
             "env": env_fingerprint, "model_source": model_source, "code": code}
    if runplan.recipe(cfg, precision):  # a rung with recipes: the one it runs
        parts["fp8_recipe"] = runplan.recipe(cfg, precision)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


class Bench:
    """One precision's setup on one device (the trainer's builder: ``train.setup.build``), and its batches."""

    def __init__(self, cfg: Config, data: dict, device: torch.device, precision: str):
        self.cfg, self.data, self.device, self.precision = cfg, data, device, precision
        s = setup.build(runplan.for_precision(cfg, precision, device.type), data["meta"], device)
        self.input_size = s.input_size
        self.model = s.model
        self.step_model = s.step_model
        self.opt = s.opt
        self.policy = s.policy
        self.scaler = s.scaler
        x, y = self.data["train"]
        if not isinstance(x, torch.Tensor):  # a streamed folder's files: a pool decoded once, the points drawn from it
            keep = torch.randperm(len(y), generator=torch.Generator().manual_seed(cfg.seed))[:POOL].sort().values
            x, y = x[keep], y[keep]
        self.pool = x, y
        x, y = next(self.batches(8).epoch(0))
        # per image: the same at any batch; None (no TFLOP/s) when the counter cannot follow the model
        self.flops_per_image = analysis("flops", models.name(cfg.model), lambda: flops.train_flops_per_image(
            setup.flops_model(s, data["meta"], device), x, y))[0]

    def batches(self, batch: int) -> DeviceBatches:
        """``batch`` images drawn from the training set (with replacement when it holds fewer)."""
        x, y = self.pool  # wherever the set is (the sweep stage leaves it memory-mapped on the host)
        g = torch.Generator(device=x.device).manual_seed(self.cfg.seed + batch)
        idx = torch.randint(0, len(y), (batch,), device=x.device, generator=g)
        meta = self.data["meta"]
        x, y = x[idx].to(self.device), y[idx].to(self.device)  # only the images a point trains on go to the device
        return DeviceBatches(x, y, batch, meta["mean"], meta["std"], augment=self.cfg.train.augment,
                             shuffle=True, channels_last=self.cfg.model.channels_last, seed=self.cfg.seed,
                             out_size=self.input_size)

    def run(self, batch: int, steps: int, feed: DeviceBatches | None = None) -> clock.StepClock:
        """``WARMUP`` untimed then ``steps`` timed optimizer steps at ``batch``, on the trainer's clock."""
        feed = feed or self.batches(batch)
        timer = clock.StepClock(self.device, WARMUP)
        timer.begin()
        for i in range(WARMUP + steps):
            with timer.data():
                x, y = next(feed.epoch(i))
            with timer.compute():
                step.train_step(self.step_model, self.opt, self.scaler, self.policy, x, y, batch,
                                clip=self.cfg.train.clip_grad_norm)
            timer.step_done(len(y))
        timer.end()
        return timer

    def try_step(self, batch: int) -> None:
        """One optimizer step at ``batch``, waited for, so that an error of its kernels surfaces here."""
        x, y = next(self.batches(batch).epoch(0))
        step.train_step(self.step_model, self.opt, self.scaler, self.policy, x, y, batch,
                        clip=self.cfg.train.clip_grad_norm)
        clock.synchronize(self.device)

    def free(self) -> None:
        """Drop gradients and cached blocks, e.g. after an out-of-memory attempt."""
        self.opt.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def point(self, batch: int, steps: int) -> dict:
        memory.reset_peak_memory(self.device)
        feed = self.batches(batch)
        timed = self.run(batch, steps, feed)
        x, _ = next(feed.epoch(0))
        ips = timed.imgs_per_s()
        out = {"precision": self.precision, "batch_size": batch, "imgs_per_s": ips,
               "imgs_per_s_p10_p90": stats.rate_spread(timed.step_rates()),
               "step_time_ms": stats.summarize_ms(timed.cycle_ms),
               **memory.peak_memory(self.device),
               "activation_bytes": probes.activation_bytes(self.model, x, self.policy),
               "achieved_tflops": self.flops_per_image * ips / 1e12 if ips and self.flops_per_image else None}
        self.free()
        return out

    def fixed_bytes(self) -> int:
        params = list(self.model.parameters())
        return 2 * memory.tensor_bytes(params) + memory.optimizer_state_bytes(self.opt)


# Out of memory that a library (cuBLAS, cuDNN) reports as its own error: it does not fit, as OutOfMemoryError.
OUT_OF_MEMORY = re.compile(r"out of memory|ALLOC_FAILED|CUDNN_STATUS_ALLOC", re.IGNORECASE)
# Errors at the edge of what a GPU can run that leave the process usable: that batch "does not run" (the message
# is kept). Any other CUDA, cuDNN or cuBLAS error (an illegal address, a launch failure, an execution failure)
# may leave the context broken: the search stops.
DOES_NOT_RUN = re.compile(r"unable to find an engine|CUDNN_STATUS_NOT_SUPPORTED|find a valid cuDNN algorithm"
                          r"|canUse32BitIndexMath|32-bit index math|exceeds INT_MAX|int32 index", re.IGNORECASE)
LIBRARY_ERROR = re.compile(r"CUDA error|cuDNN error|CUDNN_STATUS|CUBLAS_STATUS")


class SearchStopped(Exception):
    """A CUDA error that leaves the process unable to try another batch; ``found``: the largest batch that ran."""

    def __init__(self, batch: int, message: str, found: int = 0):
        super().__init__(f"batch {batch}: {message}")
        self.batch, self.message, self.found = batch, message, found


def _cuda_error(err: RuntimeError) -> bool:
    return isinstance(err, getattr(torch, "AcceleratorError", ())) or bool(LIBRARY_ERROR.search(str(err)))


def out_of_memory(err: BaseException) -> bool:
    """Out of memory, as torch says it or a library (cuBLAS, cuDNN) reports it as its own error."""
    return isinstance(err, torch.cuda.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and bool(OUT_OF_MEMORY.search(str(err))))


def fits(attempt: Callable[[int], object], free: Callable[[], None],
         notes: list[str] | None = None) -> Callable[[int], bool]:
    """``attempt`` turned into a yes/no, with the memory freed after each try: False on
    torch.cuda.OutOfMemoryError (it does not fit) and on a known edge error (it does not run; noted in
    ``notes``); ``SearchStopped`` on any other CUDA error; any other exception is a bug and propagates."""
    def check(batch: int) -> bool:
        try:
            attempt(batch)
        except RuntimeError as err:
            if out_of_memory(err):
                free()
                return False
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            if DOES_NOT_RUN.search(str(err)):
                free()
                if notes is not None:
                    notes.append(f"batch {batch} does not run: {first}")
                return False
            if _cuda_error(err):
                raise SearchStopped(batch, first) from err  # no free(): the context may be unusable
            raise
        free()
        return True
    return check


def largest_batch(fit: Callable[[int], bool], start: int, ceiling: int = 1 << 20) -> tuple[int, list[int], bool]:
    """The largest batch for which ``fit`` holds: doubling from ``start``, then bisection; (batch, tries, whether
    the search stopped at ``ceiling`` with the batch still fitting: then the batch is a lower bound)."""
    tries: list[int] = []
    best = 0

    def ok(b: int) -> bool:
        nonlocal best
        tries.append(b)
        try:
            good = fit(b)
        except SearchStopped as stop:
            stop.found = best
            raise
        best = max(best, b) if good else best
        return good

    if not ok(start):  # even the start fails: bisect below it
        lo, hi = 0, start
    else:
        lo = start
        while lo * 2 <= ceiling and ok(lo * 2):
            lo *= 2
        hi = lo * 2
        if hi > ceiling:
            return lo, tries, True
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, tries, False


def limit_bytes(cfg: Config, device: torch.device) -> tuple[int, str]:
    """The memory the sweep may use: sweep.memory_limit_gib, else the device's (or this machine's) total."""
    if cfg.sweep.memory_limit_gib:
        return int(cfg.sweep.memory_limit_gib * 2**30), f"sweep.memory_limit_gib = {cfg.sweep.memory_limit_gib:g}"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, torch.cuda.get_device_name(device)
    return psutil.virtual_memory().total, "this machine's memory"


def cap_memory(cfg: Config, device: torch.device) -> None:
    """On CUDA, let the process use at most sweep.memory_limit_gib (e.g. 24 to answer for a 24 GB card)."""
    if device.type == "cuda" and cfg.sweep.memory_limit_gib:
        index = torch.cuda.current_device() if device.index is None else device.index  # torch wants an index here
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.sweep.memory_limit_gib * 2**30 / total), index)


def search_max(bench: Bench, start: int, limit: int, what: str, ceiling: int = 1 << 20) -> dict:
    """On CUDA: the largest batch one optimizer step runs at, as training runs it (cuDNN autotuning on)."""
    notes: list[str] = []
    how = ("doubling, then bisection, one optimizer step per try with cuDNN autotuning on (as training runs), "
           "until torch.cuda.OutOfMemoryError")
    out = {"precision": bench.precision, "limit_bytes": limit, "limit": what, "notes": notes}
    try:
        largest, tries, capped = largest_batch(fits(bench.try_step, bench.free, notes), start, ceiling)
    except SearchStopped as stop:
        return {**out, "largest_batch": stop.found or None, "method": "stopped", "tries": [],
                "how": f"the search stopped at batch {stop.batch} on a CUDA error that leaves the process "
                       f"unusable ({stop.message}); the largest batch that ran before it"}
    if capped:
        return {**out, "largest_batch": largest, "method": "lower bound", "tries": tries,
                "how": f"{how}; it still ran at the search's ceiling of {ceiling:,} images, so the largest is at "
                       "least that"}
    return {**out, "largest_batch": largest, "method": "measured", "tries": tries, "how": how}


def find_max(bench: Bench, points: list[dict], cfg: Config, dataset_bytes: int) -> dict:
    """The largest batch that fits: searched on CUDA, estimated on a CPU."""
    limit, what = limit_bytes(cfg, bench.device)
    fitting = sorted(p["batch_size"] for p in points)
    if bench.device.type == "cuda":
        return search_max(bench, fitting[-1] if fitting else 1, limit, what)
    by_batch = {p["batch_size"]: p["activation_bytes"] for p in points}
    if len(by_batch) < 2:
        return {"precision": bench.precision, "largest_batch": None, "method": "estimate",
                "how": "needs two swept batch sizes", "limit_bytes": limit, "limit": what}
    (b1, a1), (b2, a2) = min(by_batch.items()), max(by_batch.items())
    per_image = (a2 - a1) / (b2 - b1) if b2 != b1 else a2 / b2
    fixed = bench.fixed_bytes() + dataset_bytes
    largest = int((limit - fixed) // per_image) if per_image > 0 and limit > fixed else 0
    return {"precision": bench.precision, "largest_batch": largest, "method": "estimate",
            "how": "(limit - parameters, gradients, optimizer state and data set) / activation bytes per image, "
                   f"from the swept batches {b1} and {b2}",
            "bytes_per_image": per_image, "fixed_bytes": fixed, "limit_bytes": limit, "limit": what}


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
    for precision in precisions:
        wanted.update(f"{precision}-{batch}.json" for batch in cfg.sweep.batch_sizes)  # kept, even if this fails
        bench, why = analysis("sweep", f"{models.name(cfg.model)} ({precision}: its setup)", Bench, cfg, prepared,
                              device, precision)
        if bench is None:
            failed += [{"precision": precision, "batch_size": b, "error": why} for b in cfg.sweep.batch_sizes]
            continue
        points, budget = [], PointBudget(cfg, device)
        for batch in sorted(cfg.sweep.batch_sizes):
            path = points_dir / f"{precision}-{batch}.json"
            key = point_key(cfg, precision, batch, prepared["meta"], env_fingerprint, model_source, code)
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
                                                       model_source, code), [p["key"] for p in points],
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
              "cpu_point_budget_s": cfg.sweep.cpu_point_budget_s if device.type == "cpu" else None}
    write_json(out / "max.json", largest)
    atomic_write(out / "sweep.csv", csv_text(rows, SWEEP_COLUMNS))
    write_json(out / "sweep.json", result)
    return result


def _dataset_bytes(prepared: dict) -> int:
    """Bytes of the set in memory (a streamed folder's images are decoded per batch: its labels alone)."""
    return sum(t.nbytes for split in ("train", "test") for t in prepared[split])
