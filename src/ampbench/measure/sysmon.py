"""System metrics sampled during training, in a background thread: CPU, memory, and the GPU when NVML is there.

Written to the run folder as ``system.csv`` and logged to MLflow with the run,
so tracking never has to be reachable while training. GPU readings need
``nvidia-ml-py`` (``import pynvml``); without it only CPU and memory are sampled.
"""

from __future__ import annotations

import os
import threading
import time

import psutil

COLUMNS = ["t_s", "process_cpu_percent", "process_rss_bytes", "system_memory_percent", "gpu_util_percent",
           "gpu_memory_used_bytes"]


def _nvml_handle():
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # no NVML library, no GPU, or no driver: sample CPU and memory only
        return None, None


class SystemMonitor:
    """``with SystemMonitor(interval_s) as mon: ...``; then ``mon.rows``."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s, self.rows = interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ampbench-sysmon", daemon=True)

    def _loop(self) -> None:
        proc = psutil.Process(os.getpid())
        proc.cpu_percent(None)  # the first reading is meaningless; prime it
        nvml, handle = _nvml_handle()
        t0 = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            row = {"t_s": round(time.perf_counter() - t0, 3), "process_cpu_percent": proc.cpu_percent(None),
                   "process_rss_bytes": proc.memory_info().rss,
                   "system_memory_percent": psutil.virtual_memory().percent,
                   "gpu_util_percent": None, "gpu_memory_used_bytes": None}
            if handle is not None:
                row["gpu_util_percent"] = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                row["gpu_memory_used_bytes"] = nvml.nvmlDeviceGetMemoryInfo(handle).used
            self.rows.append(row)

    def __enter__(self) -> SystemMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
