"""System metrics sampled during training, in a background thread: CPU, memory, and the GPU when NVML is there.

Written to the run folder as ``system.csv`` and logged to MLflow with the run,
so tracking never has to be reachable while training. GPU readings need
``nvidia-ml-py`` (``import pynvml``); without it only CPU and memory are sampled.

The GPU sampled is the one training runs on: NVML numbers GPUs in PCI order, not as ``CUDA_VISIBLE_DEVICES``
or torchrun's LOCAL_RANK do, so the handle is found by the device's UUID, never by index 0. Besides
utilisation and memory it samples the SM clock, the temperature and the power: variants run one after another,
and a GPU that heats up and throttles during the later ones would skew the comparison; power over throughput
gives the energy per image. A reading NVML cannot give (a MIG slice has no utilisation counter, for one) is
left empty, and ``gpu_unavailable`` names it, instead of stopping the sampler.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import psutil

BUSY_PERCENT = 50  # a sample of a working GPU: its utilisation at least this

COLUMNS = ["t_s", "process_cpu_percent", "process_rss_bytes", "system_memory_percent", "gpu_util_percent",
           "gpu_memory_used_bytes", "gpu_sm_clock_mhz", "gpu_temperature_c", "gpu_power_w", "gpu_unavailable"]


def nvml_handle(uuid: str | None):
    """(pynvml, the handle of the GPU with this UUID) or (None, None): no NVML, no GPU, no such UUID."""
    if not uuid:
        return None, None
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # no NVML library, no driver
        return None, None
    for name in (uuid, f"GPU-{uuid}", f"MIG-{uuid}"):  # torch gives the UUID bare; NVML wants its prefix
        try:
            return pynvml, pynvml.nvmlDeviceGetHandleByUUID(name)
        except Exception:
            continue
    return None, None


def device_uuid(device) -> str | None:
    """The UUID of a torch CUDA device (``str(props.uuid)``), or None for a CPU."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    return str(torch.cuda.get_device_properties(index).uuid)


def gpu_readings(nvml, handle) -> dict:
    """One sample of the GPU; a reading NVML refuses is None, and named in ``gpu_unavailable``."""
    reads = {
        "gpu_util_percent": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
        "gpu_memory_used_bytes": lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used,
        "gpu_sm_clock_mhz": lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
        "gpu_temperature_c": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
        "gpu_power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000,  # NVML reports milliwatts
    }
    row, missing = {}, []
    for key, read in reads.items():
        try:
            row[key] = read()
        except Exception as err:  # e.g. NVMLError_NotSupported on a MIG slice
            row[key] = None
            missing.append(f"{key}: {type(err).__name__}")
    row["gpu_unavailable"] = "; ".join(missing) or None
    return row


def summary(rows: list[dict], imgs_per_s: float | None) -> dict:
    """Median SM clock, temperature and power over the samples, and the energy per image they imply."""
    def median(key):
        values = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
        return statistics.median(values) if values else None

    power = median("gpu_power_w")
    # the clock while the GPU worked (an idle GPU clocks down: the stage's start and its evaluations would read as
    # a moving clock): the steadiness guard's third measure
    busy = [float(r["gpu_sm_clock_mhz"]) for r in rows if r.get("gpu_sm_clock_mhz") not in (None, "")
            and float(r.get("gpu_util_percent") or 0) >= BUSY_PERCENT]
    deciles = statistics.quantiles(busy, n=10, method="inclusive") if len(busy) >= 2 else None  # within the data
    return {"gpu_sm_clock_mhz_median": median("gpu_sm_clock_mhz"),
            "gpu_sm_clock_mhz_p10_p90": [deciles[0], deciles[-1]] if deciles else None,
            "gpu_temperature_c_median": median("gpu_temperature_c"), "gpu_power_w_median": power,
            "energy_per_image_j": power / imgs_per_s if power is not None and imgs_per_s else None}


class SystemMonitor:
    """``with SystemMonitor(interval_s, gpu_uuid) as mon: ...``; then ``mon.rows``."""

    def __init__(self, interval_s: float = 0.5, gpu_uuid: str | None = None):
        self.interval_s, self.gpu_uuid, self.rows = interval_s, gpu_uuid, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ampbench-sysmon", daemon=True)

    def _loop(self) -> None:
        proc = psutil.Process(os.getpid())
        proc.cpu_percent(None)  # the first reading is meaningless; prime it
        nvml, handle = nvml_handle(self.gpu_uuid)
        no_gpu = dict.fromkeys(COLUMNS[4:])
        if self.gpu_uuid and handle is None:  # training on a GPU that NVML cannot be asked about
            no_gpu["gpu_unavailable"] = "NVML: not installed (pip install nvidia-ml-py) or no GPU with this UUID"
        t0 = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            row = {"t_s": round(time.perf_counter() - t0, 3), "process_cpu_percent": proc.cpu_percent(None),
                   "process_rss_bytes": proc.memory_info().rss,
                   "system_memory_percent": psutil.virtual_memory().percent}
            row.update(gpu_readings(nvml, handle) if handle is not None else no_gpu)
            self.rows.append(row)

    def __enter__(self) -> SystemMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
