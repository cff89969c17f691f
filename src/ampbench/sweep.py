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
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from ampbench import flops, measure, models, probes, step
from ampbench.config import Config, to_dict
from ampbench.data import DeviceBatches
from ampbench.env import set_tf32
from ampbench.precision import PrecisionPolicy

WARMUP = 2  # untimed steps before each point's timed ones (allocation, cuDNN autotuning)
SOURCES = ("sweep.py", "step.py", "measure.py", "precision.py", "data/batches.py", "models/__init__.py")


def point_key(cfg: Config, precision: str, batch: int, meta: dict, env_fingerprint: str) -> str:
    """A hash of everything one point's numbers depend on: its settings, the data, the machine and this code."""
    h = hashlib.sha256()
    parts = {"precision": precision, "batch": batch, "steps": cfg.sweep.steps, "seed": cfg.seed,
             "model": to_dict(cfg.model), "amp": to_dict(cfg.amp), "augment": cfg.train.augment,
             "allow_tf32": cfg.train.allow_tf32, "limit": cfg.sweep.memory_limit_gib, "data": meta,
             "env": env_fingerprint}
    h.update(json.dumps(parts, sort_keys=True).encode())
    root = Path(__file__).parent
    for name in SOURCES:
        h.update((root / name).read_bytes())
    return h.hexdigest()[:16]


class Bench:
    """One precision's model, optimizer and scaler on one device, and the batches it is fed."""

    def __init__(self, cfg: Config, data: dict, device: torch.device, precision: str):
        self.cfg, self.data, self.device, self.precision = cfg, data, device, precision
        meta = data["meta"]
        self.input_size = models.input_size(cfg.model, meta["image_shape"][-1])
        torch.manual_seed(cfg.seed)
        set_tf32(cfg.train.allow_tf32)
        self.model = models.build(cfg.model, num_classes=meta["num_classes"], image_size=self.input_size,
                                  device=device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.train.lr, momentum=cfg.train.momentum,
                                   weight_decay=cfg.train.weight_decay, nesterov=True)
        self.policy = PrecisionPolicy(precision, device.type, cfg.amp if precision == "fp16" else None)
        self.scaler = self.policy.scaler()
        x, y = next(self.batches(8).epoch(0))
        self.flops_per_image = flops.train_flops_per_image(self.model, x, y)  # per image: the same at any batch

    def batches(self, batch: int) -> DeviceBatches:
        """``batch`` images drawn from the training set (with replacement when it holds fewer)."""
        x, y = self.data["train"]
        g = torch.Generator(device=x.device).manual_seed(self.cfg.seed + batch)
        idx = torch.randint(0, len(y), (batch,), device=x.device, generator=g)
        meta = self.data["meta"]
        return DeviceBatches(x[idx], y[idx], batch, meta["mean"], meta["std"], augment=self.cfg.train.augment,
                             shuffle=True, channels_last=self.cfg.model.channels_last, seed=self.cfg.seed,
                             out_size=self.input_size)

    def run(self, batch: int, steps: int, feed: DeviceBatches | None = None) -> list[float]:
        """``WARMUP`` untimed then ``steps`` timed optimizer steps at ``batch``; their end-to-end times (ms)."""
        feed = feed or self.batches(batch)
        timer = measure.StepTimer(self.device)
        for i in range(WARMUP + steps):
            if i >= WARMUP:
                timer.start()
            x, y = next(feed.epoch(i))
            step.train_step(self.model, self.opt, self.scaler, self.policy, x, y, batch)
            if i >= WARMUP:
                timer.stop()
        return timer.read_ms()

    def free(self) -> None:
        """Drop gradients and cached blocks, e.g. after an out-of-memory attempt."""
        self.opt.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def point(self, batch: int, steps: int) -> dict:
        measure.reset_peak_memory(self.device)
        feed = self.batches(batch)
        times = self.run(batch, steps, feed)
        summary = measure.summarize_ms(times)
        spread = measure.throughput_spread(batch, summary)
        x, _ = next(feed.epoch(0))
        ips = spread[0] if spread else None
        out = {"precision": self.precision, "batch_size": batch, "imgs_per_s": ips,
               "imgs_per_s_p10_p90": list(spread[1:]) if spread else None, "step_time_ms": summary,
               **measure.peak_memory(self.device),
               "activation_bytes": probes.activation_bytes(self.model, x, self.policy),
               "achieved_tflops": self.flops_per_image * ips / 1e12 if ips else None}
        self.free()
        return out

    def fixed_bytes(self) -> int:
        params = list(self.model.parameters())
        return 2 * measure.tensor_bytes(params) + measure.optimizer_state_bytes(self.opt)


def fits(attempt: Callable[[int], object], free: Callable[[], None]) -> Callable[[int], bool]:
    """``attempt`` turned into a yes/no: False on torch.cuda.OutOfMemoryError, with the memory freed either way."""
    def check(batch: int) -> bool:
        try:
            attempt(batch)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            free()
    return check


def largest_batch(fit: Callable[[int], bool], start: int, ceiling: int = 1 << 20) -> tuple[int, list[int]]:
    """The largest batch for which ``fit`` holds: doubling from ``start``, then bisection; (batch, tries)."""
    tries: list[int] = []

    def ok(b: int) -> bool:
        tries.append(b)
        return fit(b)

    if not ok(start):  # even the start fails: bisect below it
        lo, hi = 0, start
    else:
        lo = start
        while lo * 2 <= ceiling and ok(lo * 2):
            lo *= 2
        hi = lo * 2
        if hi > ceiling:
            return lo, tries
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, tries


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
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.sweep.memory_limit_gib * 2**30 / total), device)


def find_max(bench: Bench, points: list[dict], cfg: Config, dataset_bytes: int) -> dict:
    """The largest batch that fits: searched on CUDA, estimated on a CPU."""
    limit, what = limit_bytes(cfg, bench.device)
    fitting = sorted(p["batch_size"] for p in points)
    if bench.device.type == "cuda":
        largest, tries = largest_batch(fits(lambda b: bench.run(b, 1), bench.free), fitting[-1] if fitting else 1)
        return {"precision": bench.precision, "largest_batch": largest, "method": "measured",
                "how": "doubling, then bisection, until torch.cuda.OutOfMemoryError", "tries": tries,
                "limit_bytes": limit, "limit": what}
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
