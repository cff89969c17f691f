"""Host work per step: the engine against the PyTorch AMP recipe's step, where the host's work is all a step is.

    python benchmarks/overhead.py --host                                          # fp32 and fp16, one process
    torchrun --standalone --nproc-per-node 2 benchmarks/overhead.py --host        # under 2 gloo ranks (DDP)

The model is one small Linear over the flattened image and the batch a handful of images, so a step's compute is a
few microseconds and its time is what the host does: launching ops, Python, bookkeeping. Interleaved rounds of:

- the plain loop: pre-normalised images already on the device, indexed by a random permutation, and the recipe's
  step (zero_grad, autocast, forward, loss, scaler.scale(loss).backward(), scaler.step, scaler.update), nothing else;
- the engine as `dvc repro` runs it: ``runner.train`` with its progress bar, step clock, system monitor, ledger,
  the loss sync every 25 steps (checkpoints come between epochs, not steps), without augmentation (like for like);
- the engine with each per-step part switched off in turn (a no-op in its place), which says what the part costs.

On a CPU a step's time is the main thread's CPU time (``time.thread_time``; with one torch thread, compute
included), which a neighbour on a shared machine does not stretch as it stretches wall time. Each round's figure is
the fastest epoch after a first, warm-up one; each reported figure the median over the rounds.
The last line: ``host work per step: engine X us, plain loop Y us, engine/plain Z``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from ampbench import config, data, models
from ampbench.config import ModelConfig, ProfileConfig, TrainConfig
from ampbench.measure import clock, sysmon
from ampbench.precision import amp_settings, rung
from ampbench.runplan import RunPlan
from ampbench.train import distributed, engine, runner, setup
from ampbench.train.policy import dtype

SAME = "plain loop, the engine's batches"
FACTORY = "host:tiny"  # this module, on sys.path as the script's folder
EPOCHS = 4  # the first warms up; a figure is the fastest of the others (noise on a shared machine only adds time)


def tiny(num_classes: int = 10) -> nn.Module:
    """A model whose step is a few microseconds of compute: one Linear over the flattened 3x32x32 image."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))


def _plan(precision: str, device: str, seed: int, batch: int) -> RunPlan:
    """The engine's run: EPOCHS epochs, no augmentation, no profile or audit."""
    return RunPlan(variant="engine", precision=precision, accum_steps=1, device=device, seed=seed,
                   model=ModelConfig(factory=FACTORY), profile=ProfileConfig(steps=0),
                   train=TrainConfig(epochs=EPOCHS, batch_size=batch, warmup_steps=5, augment=False,
                                     eval_batch_size=256),
                   amp=amp_settings(precision, config.AmpConfig(audit_batches=0)))


def recipe_autocast(device: str, precision: str) -> dict:
    """``torch.autocast``'s arguments for ``precision`` on ``device`` (disabled where the rung has no autocast)."""
    return {"device_type": device, "dtype": dtype(precision), "enabled": rung(precision).autocast is not None}


def recipe_step(model, opt, scaler, autocast: dict, x: torch.Tensor, y: torch.Tensor) -> None:
    """PyTorch's AMP recipe's step, and nothing else: zero_grad, autocast forward and loss, scaled backward, the
    scaler's step and update."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast(**autocast):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def plain_us(prepared: dict, batch: int, precision: str, device: str, seed: int, engines_batches: bool = False,
             world: distributed.World = distributed.SINGLE) -> float:
    """The recipe's step over pre-normalised batches on the device (``engines_batches``: over the engine's own
    batches, uint8 on the device normalised per batch); microseconds per step of its fastest epoch after the
    first."""
    torch.manual_seed(seed)
    x_u8, y_all = prepared["train"]
    mean = torch.tensor(prepared["meta"]["mean"], device=device).view(1, 3, 1, 1)
    std = torch.tensor(prepared["meta"]["std"], device=device).view(1, 3, 1, 1)
    x_all = ((x_u8.float() / 255 - mean) / std).contiguous(memory_format=torch.channels_last)
    model = models.build(ModelConfig(factory=FACTORY), num_classes=10, image_size=32, device=device)
    opt = setup.optimizer(_plan(precision, device, seed, batch), model.parameters())  # the engine's, like for like
    model = distributed.wrap(model, world)  # DDP under several ranks: the gradients all-reduced in backward
    scaler = torch.amp.GradScaler(device, enabled=rung(precision).grad_scaler)
    autocast = recipe_autocast(device, precision)
    steps = len(y_all) // batch
    feed = engine.make_batches(_plan(precision, device, seed, batch), prepared, world)[0]
    part = feed.part(batch)  # this rank's slice of each global batch (all of it in one process)

    def batches(e: int):
        if engines_batches:
            return feed.epoch(e)
        g = torch.Generator(device=device).manual_seed(seed * 100 + e)  # the same order on every rank
        split = torch.randperm(len(y_all), device=device, generator=g)[:steps * batch].split(batch)
        return ((x_all[idx], y_all[idx]) for idx in ([i[part] for i in split] if world.active else split))

    def epoch(e: int) -> float:
        feed_e = batches(e)
        clock.synchronize(device)
        t0 = time.thread_time()
        for x, y in feed_e:
            recipe_step(model, opt, scaler, autocast, x, y)
        clock.synchronize(device)
        return (time.thread_time() - t0) / steps * 1e6

    epoch(0)  # warm-up: the engine's first epoch is not counted either
    return min(epoch(e) for e in range(1, EPOCHS))


# Each part of the engine's per-step work, and how the benchmark switches it off (``mp``: a ``Patches``).
def _no_clock(mp) -> None:
    mp.setattr(clock.StepClock, "data", lambda self: contextlib.nullcontext())
    mp.setattr(clock.StepClock, "compute", lambda self: contextlib.nullcontext())
    mp.setattr(clock.StepClock, "step_done", lambda self, images: setattr(self, "process_steps",
                                                                           self.process_steps + 1))
    mp.setattr(clock.StepClock, "end", lambda self: (0, 0.0))


def _no_ledger(mp) -> None:
    from ampbench.train import ledger
    mp.setattr(ledger.StepLedger, "mark", lambda self: None)
    mp.setattr(ledger.StepLedger, "record", lambda self, mark, loss, n: False)
    mp.setattr(engine.Trainer, "mean_loss", lambda self: 0.0)


def _no_phase(mp) -> None:
    mp.setattr(sysmon, "set_phase", lambda name: None)


def _no_vote(mp) -> None:
    mp.setattr(distributed.StopVote, "__call__", lambda self, wish: False)


PARTS = {"step clock": _no_clock, "ledger and loss sync": _no_ledger, "monitor phase tag": _no_phase}
DDP_PARTS = {"stop vote": _no_vote}  # under several ranks only


@contextlib.contextmanager
def _cpu_clock(device):
    """``clock.wall_clock``'s form, in this thread's CPU time: the host's work, which a neighbour on a shared
    machine cannot stretch as it stretches wall time (one torch thread: the CPU's compute is this thread's too)."""
    out = {"s": 0.0}
    t0 = time.thread_time()
    try:
        yield out
    finally:
        out["s"] = time.thread_time() - t0


class Patches:
    """A small monkeypatch: set attributes, and put them back on exit."""

    def __init__(self):
        self.saved = []

    def setattr(self, obj, name, value) -> None:
        self.saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)


def engine_us(prepared: dict, batch: int, precision: str, device: str, seed: int, *, off: str = "",
              progress: bool = True, monitor: bool = True, world: distributed.World = distributed.SINGLE) -> float:
    """The engine's fastest epoch after the first, microseconds per step; ``off``: a part of ``PARTS`` off."""
    plan = _plan(precision, device, seed, batch)
    with Patches() as mp, contextlib.redirect_stderr(io.StringIO()):  # the bar draws, where nobody reads it
        mp.setattr(clock, "wall_clock", _cpu_clock)  # the epoch's time: this thread's CPU seconds
        if off:
            {**PARTS, **DDP_PARTS}[off](mp)
        with sysmon.SystemMonitor(interval_s=0.5) if monitor else contextlib.nullcontext():
            result = runner.train(plan, prepared, progress=progress, profile=False, world=world)
    return min(row["epoch_time_s"] for row in result.history[1:]) / (len(prepared["train"][1]) // batch) * 1e6


def _engine_without(prepared: dict, batch: int, device: str, world, part: str, precision: str, seed: int) -> float:
    return engine_us(prepared, batch, precision, device, seed, off=part, world=world)


def run(precisions: list[str], rounds: int, batch: int, images: int, device: str,
        world: distributed.World = distributed.SINGLE) -> dict:
    """Interleaved rounds; per precision the median microseconds per step of each figure. Under several ranks
    every rank runs the same figures in the same order (each is collective) and reports its own."""
    prepared = data.synthetic_in_memory(images, 256, seed=0, device=device)
    parts = {**PARTS, **(DDP_PARTS if world.active else {})}
    figures = {"plain loop": lambda p, r: plain_us(prepared, batch, p, device, r, world=world),
               SAME: lambda p, r: plain_us(prepared, batch, p, device, r, True, world=world),
               "engine": lambda p, r: engine_us(prepared, batch, p, device, r, world=world),
               "engine, no progress bar": lambda p, r: engine_us(prepared, batch, p, device, r, progress=False,
                                                                 world=world),
               "engine, no system monitor": lambda p, r: engine_us(prepared, batch, p, device, r, monitor=False,
                                                                   world=world),
               **{f"engine, no {part}": functools.partial(_engine_without, prepared, batch, device, world, part)
                  for part in parts}}
    out = {}
    for p in precisions:
        got: dict[str, list[float]] = {k: [] for k in figures}
        for r in range(rounds):
            names = list(figures)
            for name in names[r % len(names):] + names[:r % len(names)]:  # a drift favours no figure
                got[name].append(figures[name](p, r))
        out[p] = {k: statistics.median(v) for k, v in got.items()}
        out[p]["rounds"] = got
    return out


def _ratio(rounds: dict, a: str, b: str) -> float:
    """The median over the rounds of ``a``'s time over ``b``'s in the same round: a drift between rounds cancels."""
    return statistics.median(x / y for x, y in zip(rounds[a], rounds[b], strict=True))


def report(found: dict, batch: int, device: str, world: distributed.World = distributed.SINGLE) -> list[str]:
    ranks = f", rank 0 of {world.size} ({world.backend})" if world.active else ""
    lines = [f"host work per step (median of {len(next(iter(found.values()))['rounds']['engine'])} rounds, global "
             f"batch {batch}, {device}, torch {torch.__version__}, {torch.get_num_threads()} thread(s){ranks}; "
             "ratios: the median of each round's ratio)"]
    for p, row in found.items():
        r = row["rounds"]
        eng, plain, same = row["engine"], row["plain loop"], row[SAME]
        lines.append(f"{p}: plain loop {plain:.1f} us, engine {eng:.1f} us, engine/plain "
                     f"{_ratio(r, 'engine', 'plain loop'):.3f}")
        lines.append(f"  the plain loop over the engine's batches  {same:8.1f} us   (against pre-normalised images: "
                     f"{_ratio(r, SAME, 'plain loop'):.3f}; the engine against it: {_ratio(r, 'engine', SAME):.3f})")
        for name, us in row.items():
            if name.startswith("engine, no"):
                lines.append(f"  {name:<40} {us:8.1f} us   (engine over it: {_ratio(r, 'engine', name):.3f})")
    for p, row in found.items():
        lines.append(f"host work per step ({p}): engine {row['engine']:.1f} us, plain loop {row['plain loop']:.1f} us, "
                     f"engine/plain {_ratio(row['rounds'], 'engine', 'plain loop'):.3f}")
    return lines
