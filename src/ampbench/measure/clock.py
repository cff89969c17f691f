"""Time on the device: synchronised step timers and wall clocks.

Timing rules: warm-up steps are dropped by the caller; on CUDA each step is
bracketed by CUDA events (no host sync inside the loop, one sync when the
times are read); on the CPU, where kernels run synchronously, a monotonic clock.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class StepTimer:
    """Times intervals on ``device`` without syncing the host inside the timed loop."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._open: list = []
        self._pairs: list = []

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        self._open.append(self._mark())

    def stop(self) -> None:
        self._pairs.append((self._open.pop(), self._mark()))

    def read_ms(self) -> list[float]:
        """Elapsed milliseconds of each interval since the last read (syncs the device once)."""
        if self.cuda:
            torch.cuda.synchronize()
            out = [a.elapsed_time(b) for a, b in self._pairs]
        else:
            out = [(b - a) * 1000 for a, b in self._pairs]
        self._pairs = []
        return out


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels, so that a host clock read after it is honest."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@contextmanager
def wall_clock(device: torch.device | str):
    """Wall time of a block, with the device synchronised at both ends; yields a dict with ``s``."""
    synchronize(device)
    out = {"s": 0.0}
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        synchronize(device)
        out["s"] = time.perf_counter() - t0


class StepClock:
    """The one clock of training steps, for the trainer, the sweep and the profile alike.

    Each step is timed three ways on the device: its data (indexing, crop, flip, normalisation), its compute
    (forward, backward, optimizer step) and its cycle, from one step's data to the next's, which also holds the
    host's work between steps (what a wall clock around the loop sees). The first ``warmup`` steps of each
    process are not counted (a resumed process starts cold again). img/s is one thing everywhere: timed images
    over summed cycle time (``imgs_per_s``); its spread is the p10 and p90 of the per-step rates.

    Usage: ``begin()``, then per step ``with clock.data(): ...``, ``with clock.compute(): ...``,
    ``clock.step_done(images)``; ``end()`` reads the device once and returns the window's timed images and
    cycle milliseconds. ``state_dict``/``load_state_dict`` carry the counts through a checkpoint.
    """

    STATE = ("cycle_ms", "compute_ms", "data_ms", "images")

    def __init__(self, device: torch.device | str, warmup: int):
        self.device = torch.device(device)
        self.warmup = warmup
        self.process_steps = 0       # steps this process ran (warm-up is per process)
        self.cycle_ms: list[float] = []
        self.compute_ms: list[float] = []
        self.data_ms: list[float] = []
        self.images: list[int] = []  # per timed step
        self._open = False

    def begin(self) -> None:
        self._timers = [StepTimer(self.device) for _ in range(3)]  # cycle, compute, data
        self._timed: list[bool] = []
        self._sizes: list[int] = []
        self._open = False

    def _cycle_boundary(self) -> None:
        if self._open:
            self._timers[0].stop()
        self._timers[0].start()
        self._open = True

    @contextmanager
    def data(self):
        self._cycle_boundary()  # a step's cycle starts with its data
        self._timers[2].start()
        yield
        self._timers[2].stop()

    @contextmanager
    def compute(self):
        self._timers[1].start()
        yield
        self._timers[1].stop()

    def step_done(self, images: int) -> None:
        self._timed.append(self.process_steps >= self.warmup)
        self._sizes.append(images)
        self.process_steps += 1

    def end(self) -> tuple[int, float]:
        """Close the window (the timers are read after a device sync); keep its timed steps; return their images
        and cycle milliseconds."""
        if self._open:
            self._timers[0].stop()
            self._open = False
        cycle, compute, data = (t.read_ms() for t in self._timers)
        keep = [i for i, timed in enumerate(self._timed) if timed]
        self.cycle_ms += [cycle[i] for i in keep]
        self.compute_ms += [compute[i] for i in keep]
        self.data_ms += [data[i] for i in keep]
        self.images += [self._sizes[i] for i in keep]
        return sum(self._sizes[i] for i in keep), sum(cycle[i] for i in keep)

    @property
    def timed_images(self) -> int:
        return sum(self.images)

    def imgs_per_s(self) -> float | None:
        """Timed images over summed cycle time: the throughput of the timed steps, end to end."""
        total = sum(self.cycle_ms)
        return self.timed_images / (total / 1000) if total else None

    def step_rates(self) -> list[float]:
        """Each timed step's images per second, end to end: the spread of the throughput."""
        return [n / (ms / 1000) for n, ms in zip(self.images, self.cycle_ms, strict=True) if ms > 0]

    def state_dict(self) -> dict:
        return {k: list(getattr(self, k)) for k in self.STATE}

    def load_state_dict(self, state: dict) -> None:
        for k in self.STATE:
            setattr(self, k, list(state[k]))
