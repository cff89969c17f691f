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

Each sample carries the phase the training was in (``set_phase``: ``timed`` steps, ``warmup`` steps, ``other``:
evaluation, the profile, the set-up), and the clock, power and energy figures are the timed steps' alone: an
evaluation's boost clock or an idle GPU between phases is not the steady state the throughput was measured in.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from array import array

import psutil

BUSY_PERCENT = 50  # a sample of a working GPU: its utilisation at least this

COLUMNS = ["t_s", "phase", "process_cpu_percent", "process_rss_bytes", "system_memory_percent", "gpu_util_percent",
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


MAX_ROWS = 2048  # system.csv's rows (and MLflow's points per metric), however long the run: every other one is
# dropped each time they reach it, so a 24-hour run at 2 samples a second keeps one row every 128 samples
SUMMARIZED = ("gpu_sm_clock_mhz", "gpu_util_percent", "gpu_temperature_c", "gpu_power_w")  # kept for every sample
TIMED = "timed"  # the phase of the timed training steps, whose samples the summary reads
_phase = "other"  # what the training is doing now: set_phase, read by the sampling thread


def set_phase(name: str) -> None:
    """Tag the samples from now on with ``name`` (``timed``, ``warmup``, ``other``)."""
    global _phase
    _phase = name


def summary(rows: list[dict], imgs_per_s: float | None, samples: dict | None = None) -> dict:
    """Median SM clock, temperature and power over the timed steps' samples (all of them when none is tagged
    timed: an older run), and the energy per image they imply: over every sample taken when ``samples``
    (``SystemMonitor.samples``, one value per sample, NaN where none was read) is given, else over ``rows``."""
    if samples is None:
        samples = {k: [float(r[k]) if r.get(k) not in (None, "") else math.nan for r in rows] for k in SUMMARIZED}
        samples["timed"] = [1.0 if r.get("phase") == TIMED else 0.0 for r in rows]
    timed = list(samples.get("timed") or ())
    if any(timed):
        samples = {k: [v for v, t in zip(samples[k], timed, strict=True) if t] for k in SUMMARIZED}

    def median(key):
        values = [v for v in samples.get(key, ()) if not math.isnan(v)]
        return statistics.median(values) if values else None

    power = median("gpu_power_w")
    # the clock while the GPU worked (an idle GPU clocks down: the stage's start and its evaluations would read as
    # a moving clock): the steadiness guard's third measure
    busy = [c for c, u in zip(samples.get("gpu_sm_clock_mhz", ()), samples.get("gpu_util_percent", ()), strict=True)
            if not math.isnan(c) and not math.isnan(u) and u >= BUSY_PERCENT]
    deciles = statistics.quantiles(busy, n=10, method="inclusive") if len(busy) >= 2 else None  # within the data
    return {"gpu_sm_clock_mhz_median": median("gpu_sm_clock_mhz"),
            "gpu_sm_clock_mhz_p10_p90": [deciles[0], deciles[-1]] if deciles else None,
            "gpu_temperature_c_median": median("gpu_temperature_c"), "gpu_power_w_median": power,
            "energy_per_image_j": power / imgs_per_s if power is not None and imgs_per_s else None}


class SystemMonitor:
    """``with SystemMonitor(interval_s, gpu_uuid) as mon: ...``; then ``mon.rows`` (at most ``MAX_ROWS``, spread
    over the whole run) and ``mon.samples`` (the summarized readings of every sample, 8 bytes each)."""

    JOIN_S = 5.0  # how long the stage waits for the sampler at the end (an NVML call can hang)

    def __init__(self, interval_s: float = 0.5, gpu_uuid: str | None = None):
        self.interval_s, self.gpu_uuid, self.rows = interval_s, gpu_uuid, []
        self.samples = {k: array("d") for k in (*SUMMARIZED, "timed")}
        self._taken, self._every = 0, 1  # samples so far; one row kept every this many
        self._lock, self._closed = threading.Lock(), False
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
            row = {"t_s": round(time.perf_counter() - t0, 3), "phase": _phase,
                   "process_cpu_percent": proc.cpu_percent(None),
                   "process_rss_bytes": proc.memory_info().rss,
                   "system_memory_percent": psutil.virtual_memory().percent}
            row.update(gpu_readings(nvml, handle) if handle is not None else no_gpu)
            self.add(row)

    def add(self, row: dict) -> None:
        """One sample: its summarized readings always, the row itself when it falls on the kept rows' stride;
        none once the series were taken (``snapshot``)."""
        with self._lock:
            if not self._closed:
                self._add(row)

    def _add(self, row: dict) -> None:
        for k in SUMMARIZED:
            v = row.get(k)
            self.samples[k].append(math.nan if v is None else float(v))
        self.samples["timed"].append(1.0 if row.get("phase") == TIMED else 0.0)
        if self._taken % self._every == 0:
            self.rows.append(row)
            if len(self.rows) >= MAX_ROWS:  # every other row goes, and from now on one in twice as many is kept
                self.rows = self.rows[::2]
                self._every *= 2
        self._taken += 1

    def __enter__(self) -> SystemMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.JOIN_S)

    def snapshot(self) -> tuple[list[dict], dict]:
        """The kept rows and every sample's readings, copied together under the lock, and no sample added after:
        a sampler that outlived its join (an NVML call that hangs) can no longer grow one series and not
        another while the stage summarizes them."""
        with self._lock:
            self._closed = True
            return list(self.rows), {k: array("d", v) for k, v in self.samples.items()}
