"""The benchmark process's heap: glibc's malloc told to keep the memory a loop frees, for every loop alike.

On a CPU a training step's activations are malloc'd and freed each step. With glibc's defaults a block above a
threshold is mmapped apart and unmapped when freed, and the free top of the heap is given back to the kernel, so
a later step faults the same pages in again and the kernel zeroes each one. How often depends on the allocations
made before (the threshold moves with the blocks freed), so a loop's speed can come to depend on what the loops
before it in the process left (overhead.py prints each loop's minor page faults; ``--glibc-defaults`` shows them
without this). PyTorch's own CPU launcher (``torch.backends.xeon.run_cpu``) preloads TCMalloc or jemalloc for
the same reason. Here, before any loop runs: no block mmapped apart (``M_MMAP_MAX`` 0) and no heap trimmed
(``M_TRIM_THRESHOLD`` at its most), so every loop reuses what it and the loops before it freed. A process-wide
setting: the plain loops get it as the engine does. The train stage itself keeps glibc's defaults, since a CPU
run reports its peak RSS, which a heap that never gives back memory would raise (a ResNet-18 at batch 128
measured 3.0 GiB with the defaults, 4.9 GiB with this).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
INT_MAX = 2**31 - 1
OTHER_MALLOCS = ("tcmalloc", "jemalloc", "mimalloc")


def _preloaded_malloc() -> str | None:
    """A malloc other than glibc's that this process loaded (LD_PRELOAD), whose own policy then applies."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    return next((name for name in OTHER_MALLOCS if name in maps), None)


def keep_freed_memory() -> str:
    """Keep freed memory in this process (glibc only); what was done, in words, for the benchmark's header."""
    if not sys.platform.startswith("linux"):
        return f"the platform's own malloc ({sys.platform})"
    if other := _preloaded_malloc():
        return f"{other} (preloaded; its own policy, glibc's mallopt not applied)"
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: mallopt is absent or a stub
        return "the C library's own malloc (not glibc)"
    settings = (("no mmapped blocks", M_MMAP_MAX, 0), ("no trimming", M_TRIM_THRESHOLD, INT_MAX))
    took = {name: libc.mallopt(param, value) == 1 for name, param, value in settings}
    if all(took.values()):
        return "glibc malloc keeping freed memory (no mmapped blocks, no trimming) for every loop"
    done = [name for name, ok in took.items() if ok]
    return f"glibc malloc, mallopt refused {', '.join(n for n in took if n not in done)}" + \
        (f" (set: {', '.join(done)})" if done else "")
