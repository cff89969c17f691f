"""Measurement: synchronised step timers, memory meters and the statistics of step times.

Timing rules: warm-up steps are dropped by the caller; on CUDA each step is
bracketed by CUDA events (no host sync inside the loop, one sync when the
times are read); on the CPU, where kernels run synchronously, a monotonic clock.
"""

from __future__ import annotations

import gc
import math
import resource
import sys
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


# --- memory -------------------------------------------------------------------------------

def reset_peak_memory(device: torch.device | str) -> None:
    """Start the peak counters afresh; on CUDA first return cached blocks left by earlier probes."""
    if torch.device(device).type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()  # else "peak reserved" would count what the probes left in the cache
        torch.cuda.reset_peak_memory_stats()


def peak_memory(device: torch.device | str) -> dict:
    """Peak memory since the last reset: CUDA allocated and reserved, or the process's peak RSS."""
    if torch.device(device).type == "cuda":
        return {"peak_mem_bytes": torch.cuda.max_memory_allocated(),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                "mem_meter": "cuda_max_memory_allocated"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB
    return {"peak_mem_bytes": rss_bytes, "peak_reserved_bytes": None, "mem_meter": "process_peak_rss"}


class SavedTensorMeter:
    """Bytes of tensors autograd saves for backward (activation memory) while active.

    Each storage is counted once, however many saved tensors view it, so the
    count is the memory those activations really hold.
    """

    def __init__(self):
        self.bytes = 0
        self.count = 0
        self._seen: set[int] = set()

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._seen and not isinstance(t, torch.nn.Parameter):
            self._seen.add(key)
            self.bytes += storage.nbytes()
            self.count += 1
        return t

    @contextmanager
    def measure(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(v for v in state.values() if torch.is_tensor(v))
               for state in optimizer.state.values())


# --- statistics ---------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_ms(values: list[float]) -> dict:
    """Median and p10/p90 of step times in milliseconds."""
    return {"median": percentile(values, 50), "p10": percentile(values, 10),
            "p90": percentile(values, 90), "n": len(values)}


def throughput_spread(batch_size: int | None, step_ms: dict | None) -> tuple[float, float, float] | None:
    """Images per second at the median, p90 and p10 step times (slowest to fastest), or None if unmeasured."""
    st = step_ms or {}
    if not (batch_size and st.get("median") and st.get("p10") and st.get("p90")):
        return None
    return batch_size / st["median"] * 1000, batch_size / st["p90"] * 1000, batch_size / st["p10"] * 1000


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not values:
        return math.nan, math.nan
    m = sum(values) / len(values)
    if len(values) == 1:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def bootstrap_ratio_ci(base: list[float], other: list[float], *, rounds: int = 2000,
                       level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Confidence interval of median(base) / median(other) by resampling both sets.

    With step times, base = fp32 times and other = a variant's times gives the
    variant's speedup.
    """
    if not base or not other:
        return math.nan, math.nan
    g = torch.Generator().manual_seed(seed)
    b, o = torch.tensor(base, dtype=torch.float64), torch.tensor(other, dtype=torch.float64)
    bi = torch.randint(0, len(b), (rounds, len(b)), generator=g)
    oi = torch.randint(0, len(o), (rounds, len(o)), generator=g)
    ratios = b[bi].median(dim=1).values / o[oi].median(dim=1).values
    alpha = (1 - level) / 2 * 100
    r = ratios.tolist()
    return percentile(r, alpha), percentile(r, 100 - alpha)


# two-sided 95% Student t quantiles by degrees of freedom (1..30); 1.96 beyond
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042]


def t975(df: int) -> float:
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


def ratio_ci_from_repeats(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """mean(num) / mean(den) with a 95% interval from independent repeats (delta method on the log ratio).

    With throughputs, num = a variant's img/s per repeat and den = the baseline's gives the speedup.
    """
    (mn, sn), (md, sd) = mean_std(num), mean_std(den)
    ratio = mn / md
    se = math.sqrt(sn ** 2 / (len(num) * mn ** 2) + sd ** 2 / (len(den) * md ** 2))
    t = t975(min(len(num), len(den)) - 1)
    return ratio, ratio * math.exp(-t * se), ratio * math.exp(t * se)
