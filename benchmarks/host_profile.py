"""Host work per step on a GPU, from the profiler: the engine against the plain loop on a launch-bound model.

    PYTHONPATH=src python3 benchmarks/gpu_validate.py --only host_work

The small CNN at batch 32 is launch-bound on any recent GPU: its kernels take less time than the host takes to
launch them, so every microsecond the host spends per step is step time. Both loops run under torch.profiler, a
``ProfilerStep`` range around each step; from its events, per step:

- the host's work (the step range's duration on the host: Python, dispatch, kernel launches, bookkeeping; less
  the time it waited in host syncs);
- the host syncs inside it (``cudaDeviceSynchronize``, ``cudaStreamSynchronize``, ``cudaEventSynchronize``, and
  ``cudaMemcpy``: a copy to the host waits for the device), by ``ampbench.train.profiling.host_per_step``;

and from CUDA events around the step, its device time. The check fails when the engine's host time per step is more
than 5% over the plain loop's, or when it syncs more often: a sync stalls the launch queue, and 100 us of host work
on a step of about a millisecond is 10%.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import host  # beside this module
import torch

from ampbench import config, models, runplan
from ampbench.measure import clock
from ampbench.precision import rung, set_tf32
from ampbench.train import runner, setup
from ampbench.train.profiling import host_per_step

LIMIT = 1.05  # the engine's host time per step over the plain loop's
LOSS_SYNC = 1 / 25  # the engine reads the epoch's loss every 25 steps (the progress bar, the inf/NaN stop)


def judge(engine_events, plain_events, device_us: dict | None = None) -> dict:
    """The engine's host time and syncs per step against the plain loop's: passed, and the figures in us."""
    e_host, e_syncs = host_per_step(engine_events)
    p_host, p_syncs = host_per_step(plain_events)
    if not e_host or not p_host:
        return {"passed": False, "figure": None, "detail": "no ProfilerStep ranges among the events"}
    figure = {"engine_host_us": round(statistics.median(e_host), 1),
              "plain_host_us": round(statistics.median(p_host), 1),
              "engine_syncs_per_step": sum(e_syncs) / len(e_syncs),
              "plain_syncs_per_step": sum(p_syncs) / len(p_syncs)}
    figure["engine_over_plain"] = round(figure["engine_host_us"] / figure["plain_host_us"], 3)
    figure.update(device_us or {})
    passed = figure["engine_over_plain"] <= LIMIT \
        and figure["engine_syncs_per_step"] <= figure["plain_syncs_per_step"] + LOSS_SYNC
    return {"passed": passed, "figure": figure,
            "detail": f"host us per step from the profiler (engine/plain at most {LIMIT}; syncs per step at most the "
                      "plain loop's and the loss read every 25 steps); device us per step from CUDA events"}


def _plan(precision: str, batch: int, device: str) -> runplan.RunPlan:
    cfg = config.from_dict({"device": device, "model": {"arch": "small_cnn"}, "mlflow": {"enabled": False},
                            "train": {"epochs": 1, "batch_size": batch, "warmup_steps": 5, "augment": False},
                            "variants": {precision: {"precision": precision, "accum_steps": 1}},
                            "profile": {"steps": 0}, "amp": {"audit_batches": 0}})
    return runplan.make_plan(cfg, precision, device)


def _schedule(steps: int):
    return torch.profiler.schedule(wait=0, warmup=5, active=steps, repeat=1)


def _activities(device: str):
    cuda = [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else []
    return [torch.profiler.ProfilerActivity.CPU, *cuda]


def _mark(device: str):
    """A CUDA event recorded now (None on a CPU, which has no device time apart from the host's)."""
    if device != "cuda":
        return None
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def plain_events(prepared: dict, precision: str, batch: int, steps: int, device: str = "cuda"
                 ) -> tuple[list, float | None]:
    """The AMP recipe's step over pre-normalised images on the device, profiled; its events and device us per
    step (None on a CPU)."""
    plan = _plan(precision, batch, device)
    x_u8, y_all = prepared["train"]
    mean = torch.tensor(prepared["meta"]["mean"], device=device).view(1, 3, 1, 1)
    std = torch.tensor(prepared["meta"]["std"], device=device).view(1, 3, 1, 1)
    x_all = ((x_u8.float() / 255 - mean) / std).contiguous(memory_format=torch.channels_last)
    model = models.build(plan.model, num_classes=10, image_size=32, device=device)
    opt = setup.optimizer(plan, model.parameters())  # the engine's, like for like
    scaler = torch.amp.GradScaler(device, enabled=rung(precision).grad_scaler)
    autocast = host.recipe_autocast(device, precision)
    set_tf32(plan.train.allow_tf32)  # the process's TF32 and autotuning as the engine's setup sets them
    torch.backends.cudnn.benchmark = device == "cuda"
    order = torch.randperm(len(y_all), device=device)[:(5 + steps) * batch].split(batch)
    marks = []
    with torch.profiler.profile(activities=_activities(device), schedule=_schedule(steps)) as prof:
        for idx in order:
            start = _mark(device)
            host.recipe_step(model, opt, scaler, autocast, x_all[idx], y_all[idx])
            marks.append((start, _mark(device)))
            prof.step()
    clock.synchronize(device)
    device_us = statistics.median(a.elapsed_time(b) * 1000 for a, b in marks[5:]) if device == "cuda" else None
    return list(prof.events()), device_us


def engine_events(prepared: dict, precision: str, batch: int, steps: int, device: str = "cuda"
                  ) -> tuple[list, float]:
    """The engine's loop as `dvc repro` runs it, profiled (a ``ProfilerStep`` range per step); its events and its
    own clock's device us per step (CUDA events)."""
    plan = _plan(precision, batch, device)
    plan = dataclasses.replace(plan, train=dataclasses.replace(  # enough epochs for the profiled steps
        plan.train, epochs=(5 + steps) * batch // len(prepared["train"][1]) + 1))
    real = clock.StepClock.step_done
    with torch.profiler.profile(activities=_activities(device), schedule=_schedule(steps)) as prof:
        def step_done(self, images):  # the trainer's own clock marks each step's end: the profiler's step too
            real(self, images)
            if self.process_steps <= 5 + steps:
                prof.step()
        clock.StepClock.step_done = step_done
        try:
            result = runner.train(plan, prepared, progress=True, profile=False)
        finally:
            clock.StepClock.step_done = real
    return list(prof.events()), statistics.median(result.step_times_ms) * 1000


def check(prepared: dict, precisions=("fp32", "fp16"), batch: int = 32, steps: int = 30, device: str = "cuda"
          ) -> dict:
    """The engine against the plain loop, per precision; passed when every precision passes."""
    out, passed = {}, True
    for precision in precisions:
        t0 = time.perf_counter()
        p_events, p_dev = plain_events(prepared, precision, batch, steps, device)
        e_events, e_dev = engine_events(prepared, precision, batch, steps, device)
        got = judge(e_events, p_events, {"plain_device_us": p_dev and round(p_dev, 1),
                                         "engine_cycle_us": round(e_dev, 1)})
        got["figure"] = {**(got["figure"] or {}), "s": round(time.perf_counter() - t0, 1)}
        out[precision] = got["figure"]
        passed = passed and got["passed"]
    return {"figure": out, "passed": passed,
            "detail": f"small_cnn at batch {batch}, {steps} profiled steps each: host us per step (profiler), syncs "
                      f"per step, device us per step (CUDA events); engine/plain at most {LIMIT}"}


def launch_floor() -> dict:
    """The host's time per kernel launched back to back from eager PyTorch (a one-element add_, 20,000 of them):
    the roofline's launch floor on this machine, against its default."""
    from ampbench.measure import roofline
    x = torch.zeros(1, device="cuda")
    for _ in range(200):  # warm: the caching allocator, the kernel's first load
        x.add_(1.0)
    torch.cuda.synchronize()
    n = 20_000
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    torch.cuda.synchronize()
    us = (time.perf_counter() - t0) / n * 1e6
    return {"figure": {"us_per_kernel": round(us, 2), "default_us": roofline.LAUNCH_US},
            "passed": us > 0.5 and float(x.item()) == n + 200,
            "detail": f"ampbench roofline --launch-us {us:.1f} counts this machine's floor"}
