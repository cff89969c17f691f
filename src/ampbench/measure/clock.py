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

    def mark(self):
        """A point in time on the device: a recorded CUDA event, or the host's monotonic clock on a CPU."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        self._open.append(self.mark())

    def stop(self) -> None:
        self._pairs.append((self._open.pop(), self.mark()))

    def elapsed_ms(self, pairs: list[tuple]) -> list[float]:
        """Milliseconds between each pair of marks (syncs the device once)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in pairs]
        return [(b - a) * 1000 for a, b in pairs]

    def read_ms(self) -> list[float]:
        """Elapsed milliseconds of each interval since the last read (syncs the device once)."""
        out, self._pairs = self.elapsed_ms(self._pairs), []
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


class _Span:
    """A context manager that calls ``enter`` and ``exit``: made once, entered every step (a generator-based one
    would be built anew each time)."""

    __slots__ = ("enter", "exit")

    def __init__(self, enter, exit_):
        self.enter, self.exit = enter, exit_

    def __enter__(self) -> None:
        self.enter()

    def __exit__(self, *exc) -> None:
        self.exit()


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
        self._data_span = _Span(self._data_enter, self._data_exit)
        self._compute_span = _Span(self._compute_enter, self._compute_exit)
        self.begin()

    def begin(self) -> None:
        self._timer = StepTimer(self.device)  # its marks: CUDA events on a GPU, the host clock on a CPU
        self._spans: tuple[list, list, list] = ([], [], [])  # (start, end) marks of the cycles, computes, datas
        self._timed: list[bool] = []
        self._sizes: list[int] = []
        self._cycle_start = self._data_start = self._data_end = self._compute_start = None

    # Three marks a step (a CUDA event each on a GPU): the data's start, which is also where the last step's cycle
    # ends and this one's begins; the data's end, which is also the compute's start when nothing ran between; the
    # compute's end. The context managers are made once: nothing is built per step.
    def _data_enter(self) -> None:
        m = self._timer.mark()
        if self._cycle_start is not None:
            self._spans[0].append((self._cycle_start, m))
        self._cycle_start = self._data_start = m
        self._data_end = None

    def _data_exit(self) -> None:
        self._data_end = self._timer.mark()
        self._spans[2].append((self._data_start, self._data_end))

    def _compute_enter(self) -> None:
        # right after the data: the same point in time (on a GPU, the same place in the stream)
        self._compute_start = self._data_end if self._data_end is not None else self._timer.mark()
        self._data_end = None

    def _compute_exit(self) -> None:
        self._spans[1].append((self._compute_start, self._timer.mark()))

    def data(self) -> _Span:
        """``with clock.data(): ...``: the step's data (its cycle starts here)."""
        return self._data_span

    def compute(self) -> _Span:
        """``with clock.compute(): ...``: the step's forward, backward and optimizer step."""
        return self._compute_span

    def step_done(self, images: int) -> None:
        self._timed.append(self.process_steps >= self.warmup)
        self._sizes.append(images)
        self.process_steps += 1

    def end(self) -> tuple[int, float]:
        """Close the window (the marks are read after one device sync); keep its timed steps; return their images
        and cycle milliseconds."""
        if self._cycle_start is not None:
            self._spans[0].append((self._cycle_start, self._timer.mark()))
            self._cycle_start = None
        cycles, computes, datas = self._spans
        ms = self._timer.elapsed_ms(cycles + computes + datas)
        cycle, compute, data = ms[:len(cycles)], ms[len(cycles):len(cycles) + len(computes)], \
            ms[len(cycles) + len(computes):]
        self._spans = ([], [], [])
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
