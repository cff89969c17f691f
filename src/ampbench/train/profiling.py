"""Why a variant was (or was not) faster: a torch.profiler profile of a few optimizer steps, by category.

After training, outside every timed step, ``profile_run`` builds the trainer's
setup afresh (``setup.build``) with the trained model's, optimizer's and
GradScaler's state, runs one unprofiled step, then profiles
``profile.steps`` more with the engine's own step (``step.train_step``). Each
profiled op's self time (its kernels' time on a GPU, its CPU time on a CPU) goes
to one category a person understands: the tensor-core work AMP speeds up
(convolution and matmul), normalization, elementwise and activations, softmax
and reductions, the dtype casts autocast adds, the optimizer, loss scaling,
data preparation, gradient communication (under DDP), and the rest; with the
dtypes each category ran in. On CUDA also: how busy the GPU was against the
step's wall time, and kernels per step. Under DDP the profiled step is the DDP
step (every rank profiles together), and the communication the step waits for
is measured as the time a step loses to it: the same steps timed with and
without their all-reduce (``no_sync``), slowest rank each.
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

# Kineto, torch.profiler's tracer, prints start/stop lines and, on a machine without a GPU, an "ERROR" that the
# GPU count is zero; none of it is a problem, so only its fatal messages reach the terminal.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
from ampbench.measure import clock
from ampbench.train import distributed, fsdp, setup
from ampbench.train import step as step_fn

TENSOR_CORE = "conv/matmul"
CATEGORIES = (TENSOR_CORE, "normalization", "elementwise/activations", "softmax/reductions", "casts",
              "optimizer", "loss scaling", "data preparation", "communication", "other")
# What each category is to a reader, written into every profile with the order above, so that the report knows
# which time tensor cores speed up and which a precision adds without importing this module (or torch).
ROLES = {TENSOR_CORE: "tensor_core", "casts": "precision_overhead", "loss scaling": "precision_overhead",
         "other": "unattributed"}
DATA_SCOPE = "ampbench::data"
WARMUP = 2  # profiled steps thrown away before the ones that count
# Op-name patterns, matched against the name lower-cased with "_" removed (aten::native_batch_norm -> nativebatchnorm).
_PATTERNS = [
    # gloo:all_reduce, nccl:all_reduce, c10d::allreduce_, record_param_comms, ncclDevKernel_AllReduce_... kernels
    ("communication", r"^(gloo|nccl|mpi):|^nccl(dev)?kernel|^allreduce|^allgather|^reducescatter|^broadcast$"
                      r"|^barrier$|^recordparamcomms"),
    ("loss scaling", r"^amp"),  # _amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_
    # aten::_scaled_mm is fp8's GEMM (torchao's float8 training)
    (TENSOR_CORE, r"conv|addmm|^mm$|^mmbackward|bmm|matmul|^linear|scaleddotproduct|attention|^einsum|^scaledmm"),
    ("normalization", r"batchnorm|layernorm|groupnorm|instancenorm|rmsnorm"),
    ("softmax/reductions", r"softmax|^sum|^mean|nllloss|crossentropy|^norm$|^max$|^min$|argmax|^var|^std|logsumexp"
                           r"|^amax|^amin|^prod|cumsum"),
    ("casts", r"^to$|^tocopy|^copy$|^copybackward|^tocopybackward"),
    ("elementwise/activations", r"relu|gelu|silu|sigmoid|tanh|hardswish|hardsigmoid|threshold|^add|^mul|^sub|^div"
                                r"|^rsub|pool|dropout|^where|clamp|^fill|^zero|^neg|^exp|^sqrt|^rsqrt|^pow|^cat|index"
                                r"|^gather|^scatter|^pad|constantpad|upsample|^abs|^sign|^lerp|^addcmul|^addcdiv"
                                r"|^masked|^mse|^flip|^roll|^stack|^clone|^contiguous|^erf"),
]
_COMPILED = [(cat, re.compile(p)) for cat, p in _PATTERNS]
_DTYPES = {"float": "fp32", "c10::Half": "fp16", "c10::BFloat16": "bf16", "c10::Float8_e4m3fn": "fp8 e4m3",
           "c10::Float8_e5m2": "fp8 e5m2"}  # double: Python scalars


def _normal(name: str) -> str:
    """aten::native_batch_norm -> nativebatchnorm; autograd::engine::evaluate_function: MmBackward0 -> mmbackward."""
    name = name.split("evaluate_function: ")[-1].split("::")[-1]
    return name.lower().replace("_", "").rstrip("0123456789")


def categorize(name: str, scopes: Iterable[str] = ()) -> str:
    """The category of one profiled op, given its name and the names of the ops and scopes around it."""
    scopes = list(scopes)
    if DATA_SCOPE in scopes or name == DATA_SCOPE:
        return "data preparation"
    own = _normal(name)
    in_optimizer = name.startswith("Optimizer.") or any(s.startswith("Optimizer.") for s in scopes)
    if in_optimizer:
        return "loss scaling" if re.match(r"^amp", own) else "optimizer"
    for cat, pattern in _COMPILED:
        if pattern.search(own):
            return cat
    return "other"


def _dtype(event) -> str | None:
    """The dtype an op computed in: its first floating-point input's (a copy's destination, for a cast)."""
    for t in getattr(event, "input_dtypes", None) or []:
        if t in _DTYPES:
            return _DTYPES[t]
    return None


def _scopes(event) -> list[str]:
    out, parent = [], event.cpu_parent
    while parent is not None:
        out.append(parent.name)
        parent = parent.cpu_parent
    return out


def _is_kernel(event) -> bool:
    """A device event that is a kernel: not a memcpy or memset, and not Kineto's gpu_user_annotation mirror of a
    record_function range (ProfilerStep, the data range, Optimizer.step) on the GPU timeline."""
    kind = getattr(event, "activity_type", None)  # Kineto's activity type, where torch records it
    if kind is not None:
        return kind == "kernel"
    return not getattr(event, "is_user_annotation", False) and not event.name.startswith(("Memcpy", "Memset"))


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The time covered by (start, end) intervals, overlaps counted once: kernels on several streams at once
    keep the GPU busy once, not twice."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


# the host waiting for the device: time inside a step that is not the host's own work
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def host_per_step(events) -> tuple[list[float], list[int]]:
    """From torch.profiler's events, each profiled step's host work in microseconds (its ``ProfilerStep`` range on
    the host, less the time it waited in host syncs) and the number of those syncs. On a launch-bound GPU step that
    work is the step's time: each microsecond of it counts against every precision alike."""
    # the host's events only: Kineto also puts a copy of each step's range on the GPU's timeline (device CUDA)
    host_events = [e for e in events
                   if getattr(e, "device_type", torch.autograd.DeviceType.CPU) == torch.autograd.DeviceType.CPU]
    steps = sorted((e for e in host_events if e.name.startswith("ProfilerStep")), key=lambda e: e.time_range.start)
    syncs = [(e.time_range.start, e.time_range.end) for e in host_events if e.name in SYNCS]
    host, count = [], []
    for step in steps:
        start, end = step.time_range.start, step.time_range.end
        inside = [(a, b) for a, b in syncs if start <= a < end]
        host.append(end - start - sum(min(b, end) - a for a, b in inside))
        count.append(len(inside))
    return host, count


def summarize(events, steps: int, wall_ms: float, on_cuda: bool) -> dict:
    """Per category: milliseconds per step, share of the step's wall time, and the dtypes it ran in."""
    ms = defaultdict(float)
    dtype_ms: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    kernels: list[tuple[float, float]] = []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:  # device time is counted through its launching op
            if _is_kernel(e):
                kernels.append((e.time_range.start, e.time_range.end))
            continue
        us = e.self_device_time_total if on_cuda else e.self_cpu_time_total
        if us <= 0:
            continue
        cat = categorize(e.name, _scopes(e))
        ms[cat] += us / 1000
        dt = _dtype(e)
        if dt:
            dtype_ms[cat][dt] += us / 1000
    per_step = wall_ms / steps
    cats = {}
    for cat in CATEGORIES:
        if ms.get(cat):
            total = sum(dtype_ms[cat].values())
            shares = {k: v / total for k, v in sorted(dtype_ms[cat].items(), key=lambda kv: -kv[1])} if total else {}
            cats[cat] = {"ms_per_step": ms[cat] / steps, "share": ms[cat] / steps / per_step if per_step else None,
                         "dtypes": ", ".join(f"{k} {v:.0%}" for k, v in shares.items()) or None}
    out = {"steps": steps, "basis": "CUDA kernel time" if on_cuda else "CPU time of each op",
           "wall_ms_per_step": per_step, "categories": cats,
           "category_order": list(CATEGORIES), "category_roles": dict(ROLES),
           "attributed_ms_per_step": sum(ms.values()) / steps}
    if on_cuda:
        busy = busy_us(kernels)
        host, _ = host_per_step(events)
        out.update(kernels_per_step=len(kernels) / steps, gpu_busy_ms_per_step=busy / 1000 / steps,
                   gpu_busy_fraction=busy / 1000 / wall_ms if wall_ms else None,
                   host_ms_per_step=statistics.median(host) / 1000 if host else None)
    return out


def exposed_communication(step, steps: int, world: distributed.World, device: torch.device) -> dict:
    """How much of a DDP step is spent waiting for the gradient all-reduce: the steps with and without it."""
    def timed(sync: bool) -> float:
        world.barrier()
        clock.synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step(sync)
        clock.synchronize(device)
        return world.reduce([(time.perf_counter() - start) * 1000 / steps], "max")[0]  # the slowest rank

    with_ms, without_ms = timed(True), timed(False)
    return {"step_ms": with_ms, "step_ms_without_allreduce": without_ms,
            "exposed_share": max(0.0, 1 - without_ms / with_ms) if with_ms else None}


def profile_run(trainer, steps: int) -> tuple[dict, str]:
    """Profile ``steps`` optimizer steps of the trainer's setup, built afresh with its trained state; (summary,
    trace)."""
    t0 = time.perf_counter()
    device, on_cuda = trainer.device, trainer.device.type == "cuda"
    world = trainer.world
    s = setup.build(trainer.plan, trainer.data_meta, device, world)  # as training runs it, compiled or not
    s.load_state(trainer.model.state_dict(), trainer.opt.state_dict(), trainer.scaler.state_dict())

    def epochs():  # epochs training never saw, as many as the steps need
        e = trainer.plan.train.epochs
        while True:
            yield from trainer.train_batches.epoch(e)
            e += 1

    batches = epochs()

    def train(x, y, sync: bool = True) -> None:
        with distributed.sync_context(s.step_model, sync):  # sync=False: no all-reduce at all
            step_fn.train_step(s.step_model, s.opt, s.scaler, s.policy, x, y, trainer.micro,
                               clip=trainer.plan.train.clip_grad_norm, norms=[] if trainer.log_norms else None)

    def step(sync: bool = True) -> None:
        with record_function(DATA_SCOPE):  # the engine's data path: index, crop, flip, normalise on the device
            x, y = next(batches)
        train(x, y, sync)

    step()  # unprofiled: allocations, cuDNN autotuning
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    # The profiler's own first step is slow (it starts its tracers): WARMUP steps are traced and thrown away.
    schedule = torch.profiler.schedule(wait=0, warmup=WARMUP, active=steps, repeat=1)
    timer = clock.StepClock(device, WARMUP)  # the trainer's clock; a step's wall time is its data and compute
    timer.begin()
    with profile(activities=activities, record_shapes=True, schedule=schedule) as prof:
        for _ in range(WARMUP + steps):
            with timer.data(), record_function(DATA_SCOPE):
                x, y = next(batches)
            with timer.compute():
                train(x, y)
            timer.step_done(len(y))
            prof.step()  # outside the step's data and compute: the profiler's own work is not the step's
    timer.end()
    wall_ms = sum(timer.data_ms) + sum(timer.compute_ms)
    summary = summarize(prof.events(), steps, wall_ms, on_cuda)
    if world.active and not fsdp.is_sharded(s.model):
        summary["communication"] = exposed_communication(step, steps, world, device)
    # (under FSDP a step without its collectives is no step: the all-gathers bring the weights, and without the
    # reduce-scatter the shards get no gradient to step with; its collectives' time is the profile's own category)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = f.read()
    finally:
        os.unlink(path)
    summary["cost_s"] = time.perf_counter() - t0
    return summary, trace
