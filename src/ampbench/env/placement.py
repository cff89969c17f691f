"""Where the data set lives and what it may take: the device's memory, the cores, shared memory for
streaming workers, and ``data.placement`` resolved.
"""

from __future__ import annotations

import math
import os
import shutil

import psutil

from ampbench.errors import EnvironmentMismatch

MEMORY_CAP_ENV = "AMPBENCH_DEVICE_MEMORY_BYTES"  # a smaller device than the one probed (tests; room for others)
DATA_SHARE = 0.5  # the most of the memory the model leaves that a resident set may take (the rest: activations)


def device_memory(device: str, info: dict) -> tuple[int, str]:
    """The training device's memory in bytes and its name in words (``AMPBENCH_DEVICE_MEMORY_BYTES`` caps it)."""
    if device == "cuda" and info.get("gpu"):
        total, what = info["gpu"]["total_memory_bytes"], f"{info['gpu']['name']}'s memory"
    else:
        total, what = psutil.virtual_memory().total, "this machine's memory"
    cap = os.environ.get(MEMORY_CAP_ENV, "")
    if cap:
        try:
            total, what = min(total, int(cap)), f"{what}, capped by {MEMORY_CAP_ENV}"
        except ValueError:
            raise EnvironmentMismatch(f"{MEMORY_CAP_ENV} = {cap!r} is not a number of bytes; set it to an integer "
                                      "such as 8589934592 (8 GiB), or unset it") from None
    return total, what


def _set_words(nbytes: int, desc: dict) -> str:
    s = desc["image_size"]
    return (f"about {nbytes / 2**30:.1f} GiB ({desc['train_count']:,} train + {desc['test_count']:,} test images of "
            f"3 x {s} x {s} uint8)")


def check_fits(nbytes: int, desc: dict, device: str, info: dict, share: float = 0.9) -> None:
    """Stop before training when the device-resident data set alone would take most of the device's memory."""
    total, what = device_memory(device, info)
    if nbytes > share * total:
        raise EnvironmentMismatch(
            f"the data set would take {_set_words(nbytes, desc)} on the {device} device, more than {share:.0%} of "
            f"{what} ({total / 2**30:.1f} GiB); set data.placement: stream (or auto) to stream it from host "
            "memory, or lower data.image_size or data.train_size")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or taskset's limit), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API on this platform
        return os.cpu_count() or 1


SHM = "/dev/shm"


def check_shared_memory(workers: int, batches_in_flight: int, batch_bytes: int, nproc: int,
                        path: str = SHM) -> str | None:
    """DataLoader workers hand each batch to the training process through shared memory (/dev/shm on Linux):
    stop when the batches in flight cannot fit there (a worker would die with a bus error mid-epoch), and warn
    when they would take more than half of it. Containers often have little: Docker gives 64 MiB by default."""
    if not workers or not os.path.isdir(path):
        return None
    need = nproc * (workers * batches_in_flight + 1) * batch_bytes  # and the batch each process is reading
    free = shutil.disk_usage(path).free
    words = (f"{nproc} process(es) x ({workers} worker(s) x {batches_in_flight} batches in flight + 1) x "
             f"{batch_bytes / 2**20:.1f} MiB = {need / 2**20:,.0f} MiB of shared memory, and {path} has "
             f"{free / 2**20:,.0f} MiB free")
    if need > free:
        size = 2 ** max(27, math.ceil(math.log2(need * 2)))  # a power of two, twice what is needed
        raise EnvironmentMismatch(f"data.placement: stream needs {words}; give the container more (docker run "
                                  f"--shm-size={size // 2**20}m, or --ipc=host), or lower data.workers or "
                                  "train.eval_batch_size / train.batch_size")
    if need > free / 2:
        return f"streaming takes {words}: more than half of it; another process's use could make a worker fail"
    return None


def choose_placement(placement: str, nbytes: int, model_bytes: int, desc: dict, device: str,
                     info: dict) -> tuple[str, str]:
    """data.placement resolved, and why: ``auto`` keeps the set on the device when it takes at most half of the
    memory that the model's weights, gradients and optimizer state leave (the other half is for activations and
    workspace), and streams it otherwise; ``device`` stops here when the set alone would not fit."""
    total, what = device_memory(device, info)
    room = max(0, total - model_bytes)
    words = f"the set, {nbytes / 2**30:.2f} GiB,"
    if placement == "device":
        check_fits(nbytes, desc, device, info)
        return "device", "data.placement: device"
    if placement == "stream":
        return "stream", "data.placement: stream"
    if nbytes <= DATA_SHARE * room:
        return "device", (f"auto: {words} fits beside the model in {what} ({total / 2**30:.1f} GiB, "
                          f"{model_bytes / 2**30:.2f} GiB for weights, gradients and optimizer state)")
    return "stream", (f"auto: {words} would take more than {DATA_SHARE:.0%} of the {room / 2**30:.1f} GiB the model "
                      f"leaves of {what}, so it streams from host memory")
