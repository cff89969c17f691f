"""Memory meters: the device's peak (CUDA allocated and reserved, or the process's peak RSS), the bytes
autograd saves for backward (activations), and the bytes of parameters, gradients and optimizer state.
"""

from __future__ import annotations

import gc
import resource
import sys
from contextlib import contextmanager

import torch


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


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s memory: itself, or a wrapper subclass's inner tensors, recursively."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [u for name in names for u in _plain(getattr(t, name))]


class SavedTensorMeter:
    """Bytes of tensors autograd saves for backward (activation memory) while active.

    Each storage is counted once, however many saved tensors view it, so the count is the memory those
    activations really hold. A tensor subclass is counted by the plain tensors inside it; a weight a subclass wraps
    (MX training's, among ``exclude``: the model's parameters) is not an activation, wherever it is saved.
    """

    def __init__(self, exclude=()):
        self.bytes = 0
        self.count = 0
        self._seen: set[int] = set()
        self._weights = {u.untyped_storage().data_ptr() for t in exclude for u in _plain(t)
                         if u is not t}  # only weights a subclass wraps: a plain model's count is as it was

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter):
            return t
        inner = _plain(t)  # a tensor subclass (MX's weight wrapper, its fp8 blocks) holds plain tensors
        for u in inner:
            storage = u.untyped_storage()
            key = storage.data_ptr()
            if key not in self._seen and key not in self._weights:  # a wrapped weight, saved unwrapped: no activation
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


class PeakWindows:
    """CUDA peak memory by phase: the largest peak over each phase's windows, e.g. steady-state training steps
    apart from evaluation. A window opens with ``torch.cuda.reset_peak_memory_stats()`` alone (host-side, no
    sync; ``empty_cache`` would sync, so it never runs mid-training) and closes by reading the peaks. On a CPU
    nothing is reset and nothing is kept: the process's peak RSS is all there is (``peak_memory``).
    """

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.peaks: dict[str, dict] = {}
        self.open_phase: str | None = None

    def open(self, phase: str) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.open_phase = phase

    def close(self) -> None:
        if self.open_phase is None:
            return
        seen = self.peaks.setdefault(self.open_phase, {"peak_mem_bytes": 0, "peak_reserved_bytes": 0})
        seen["peak_mem_bytes"] = max(seen["peak_mem_bytes"], torch.cuda.max_memory_allocated())
        seen["peak_reserved_bytes"] = max(seen["peak_reserved_bytes"], torch.cuda.max_memory_reserved())
        self.open_phase = None

    PHASES = ("first step", "train", "eval")
    KEYS = ("peak_mem_bytes", "peak_reserved_bytes")

    def state_dict(self) -> dict:
        return {k: dict(v) for k, v in self.peaks.items()}

    def flat(self) -> list[float]:
        """The peaks as one list (phase by phase, 0 for none): what ranks max-reduce before a checkpoint."""
        return [float(self.peaks.get(p, {}).get(k, 0)) for p in self.PHASES for k in self.KEYS]

    def from_flat(self, values: list[float]) -> dict:
        """``flat``'s list back into a state: the phases with a peak."""
        it = iter(values)
        state = {p: {k: int(next(it)) for k in self.KEYS} for p in self.PHASES}
        return {p: v for p, v in state.items() if v["peak_mem_bytes"]}

    def load_state_dict(self, state: dict) -> None:
        self.peaks = {k: dict(v) for k, v in state.items()}
