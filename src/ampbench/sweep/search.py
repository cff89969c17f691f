"""The largest batch that fits: searched on CUDA (doubling, then bisection, each failure's memory freed, a CUDA
error that breaks the process stopping the search), estimated on a CPU from the measured bytes per image."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil
import torch

from ampbench.config import Config

if TYPE_CHECKING:
    from ampbench.sweep.bench import Bench


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


def largest_batch(fit: Callable[[int], bool], start: int, ceiling: int = 1 << 20,
                  multiple: int = 1) -> tuple[int, list[int], bool]:
    """The largest batch for which ``fit`` holds, among multiples of ``multiple`` (a batch a converting rung can
    run): doubling from ``start``, then bisection; (batch, tries, whether the search stopped at ``ceiling`` with the
    batch still fitting: then the batch is a lower bound)."""
    if multiple > 1:  # the same search over units of ``multiple`` images
        try:
            found, tries, capped = largest_batch(lambda u: fit(u * multiple), max(1, start // multiple),
                                                 max(1, ceiling // multiple))
        except SearchStopped as stop:
            stop.found *= multiple
            raise
        return found * multiple, [t * multiple for t in tries], capped
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
    if bench.multiple > 1:
        how += f", in multiples of {bench.multiple} images (the micro-batches {bench.precision} can run on this model)"
    out = {"precision": bench.precision, "limit_bytes": limit, "limit": what, "notes": notes}
    try:
        largest, tries, capped = largest_batch(fits(bench.try_step, bench.free, notes), start, ceiling,
                                               bench.multiple)
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
    largest -= largest % bench.multiple  # a batch the rung can run
    return {"precision": bench.precision, "largest_batch": largest, "method": "estimate",
            "how": "(limit - parameters, gradients, optimizer state and data set) / activation bytes per image, "
                   f"from the swept batches {b1} and {b2}",
            "bytes_per_image": per_image, "fixed_bytes": fixed, "limit_bytes": limit, "limit": what}
