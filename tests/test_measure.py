"""The activation meter, the timers, FLOPs, the datasheet and the system monitor (statistics: test_stats)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampbench.measure import clock, memory


def test_saved_tensor_meter_counts_a_linear_layers_input_exactly():
    lin = nn.Linear(256, 8, bias=False)
    x = torch.randn(32, 256, requires_grad=False)
    meter = memory.SavedTensorMeter()
    with meter.measure():
        lin(x)
    assert meter.bytes == 32 * 256 * 4  # linear saves its input for the weight gradient; the weight is a parameter
    half = memory.SavedTensorMeter()
    with half.measure(), torch.autocast("cpu", dtype=torch.float16):
        lin(x)
    # under fp16 autocast it saves the fp16 copy of the input: exactly half the bytes
    assert half.bytes == 32 * 256 * 2


def test_cpu_timer_and_peak_memory():
    timer = clock.StepTimer("cpu")
    for _ in range(3):
        timer.start()
        torch.randn(100, 100) @ torch.randn(100, 100)
        timer.stop()
    times = timer.read_ms()
    assert len(times) == 3 and all(t > 0 for t in times) and timer.read_ms() == []
    mem = memory.peak_memory("cpu")
    assert mem["mem_meter"] == "process_peak_rss" and mem["peak_mem_bytes"] > 10 * 2**20


def test_optimizer_state_bytes():
    p = nn.Parameter(torch.zeros(10))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(10)
    opt.step()
    assert memory.optimizer_state_bytes(opt) == 40


def test_flop_count_of_a_known_layer():
    from ampbench.measure import flops
    lin = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10, bias=False))
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    # forward 2*in*out per image; backward: weight gradient only (the input needs none), another 2*in*out
    assert flops.train_flops_per_image(lin, x, y) == 2 * (2 * 3072 * 10)


def test_datasheet_peaks():
    from ampbench.measure import flops
    assert flops.datasheet_peak("NVIDIA H200", "bf16") == 989.4
    assert flops.datasheet_peak("NVIDIA H200 NVL", "bf16") == 835.5  # not the SXM figure
    assert flops.datasheet_peak("NVIDIA H100 NVL", "fp16") == 835.5  # not the PCIe one
    assert flops.datasheet_peak("NVIDIA H100 80GB HBM3", "fp8") == 1978.9
    assert flops.datasheet_peak("NVIDIA L40S", "fp16") == 362.05  # not L4's
    assert flops.datasheet_peak("NVIDIA L4", "fp16") == 121.0
    assert flops.datasheet_peak("NVIDIA GeForce RTX 5090", "fp16") == 209.5  # the article's GPU; fp32 accumulation
    assert flops.datasheet_peak("NVIDIA GeForce RTX 3090", "tf32") == 35.6
    assert flops.datasheet_peak("NVIDIA A10", "bf16") == 125.0 and flops.datasheet_peak("NVIDIA A40", "fp8") is None
    assert flops.datasheet_peak("NVIDIA B200", "fp8") == 4500.0
    assert flops.datasheet_peak("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "fp16") is None  # a slice, not the GPU
    assert flops.datasheet_peak(None, "fp16") is None
    assert flops.memory_bandwidth_gbps("NVIDIA H200") == 4800 and flops.memory_bandwidth_gbps("Tesla T4") == 320
    for _, row in flops.DATASHEET:  # one table, every column in each row; fp16 tensor cores never below tf32
        assert set(row) == {"name", "source", *flops.COLUMNS}
        assert row["fp16"] is None or row["fp16"] >= (row["tf32"] or 0)


def test_what_a_precision_means_is_said_once():
    from ampbench import config, precision
    assert precision.names() == ("fp32", "tf32", "fp16", "bf16", "fp8", "mxfp8")  # the ladder, in order
    assert config.Variant.__dataclass_fields__["precision"].metadata["choices"]() == precision.names()
    assert [precision.rung(p).datasheet for p in ("fp32", "tf32", "fp16", "bf16")] == ["fp32", "tf32", "fp16", "bf16"]
    assert [precision.rung(p).tf32 for p in ("fp32", "tf32", "fp16", "bf16")] == [False, True, False, False]
    assert precision.notes({"tf32"}, None) and precision.notes({"tf32"}, {"name": "T4", "capability": "7.5"})
    assert not precision.notes({"tf32"}, {"name": "H200", "capability": "9.0", "tf32_capable": True})
    assert not precision.notes({"fp32", "fp16"}, None)
    amp = config.AmpConfig(init_scale=1024)
    assert precision.amp_settings("fp16", amp) is amp
    assert precision.amp_settings("bf16", amp) is None and precision.amp_settings("fp32", amp) is None
    t4 = {"name": "Tesla T4", "capability": "7.5", "bf16_supported": False}
    assert "has no native bf16; remove that variant or use fp16" in precision.unsupported("bf16", t4)
    assert precision.unsupported("fp16", t4) is None and precision.unsupported("bf16", None) is None
    assert precision.unsupported("bf16", {**t4, "bf16_supported": True}) is None


class _FakeEvent:
    log: list = []

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        _FakeEvent.log.append("record")
        self.t = len(_FakeEvent.log)

    def elapsed_time(self, other):
        return float(other.t - self.t)


def test_cuda_timer_records_events_and_syncs_only_when_read(monkeypatch):
    """In the timed loop only events are recorded; the one sync happens when the times are read."""
    _FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: _FakeEvent.log.append("sync"))
    timer = clock.StepTimer.__new__(clock.StepTimer)
    timer.cuda, timer._open, timer._pairs = True, [], []
    for _ in range(3):
        timer.start()
        timer.stop()
    assert _FakeEvent.log == ["record"] * 6
    assert timer.read_ms() == [1.0, 1.0, 1.0]
    assert _FakeEvent.log[-1] == "sync" and _FakeEvent.log.count("sync") == 1


def test_wall_clock_syncs_before_and_after(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    with clock.wall_clock("cuda") as wall:
        calls.append("work")
    assert calls == ["sync", "work", "sync"] and wall["s"] >= 0


def test_step_clock_times_data_compute_and_the_whole_cycle_after_warm_up(monkeypatch):
    """A fake host clock: each step's data takes 1 ms, its compute 3 ms, the host 0.5 ms between steps."""
    now = [0.0]
    monkeypatch.setattr(clock.time, "perf_counter", lambda: now[0])

    def advance(ms):
        now[0] += ms / 1000

    c = clock.StepClock("cpu", warmup=2)
    c.begin()
    for images in (8, 8, 8, 8, 4):  # the last batch of an epoch is short
        with c.data():
            advance(1)
        with c.compute():
            advance(3)
        c.step_done(images)
        advance(0.5)
    images, cycle_ms = c.end()
    assert images == 20 and c.timed_images == 20  # the two warm-up steps are not counted
    assert c.data_ms == pytest.approx([1, 1, 1]) and c.compute_ms == pytest.approx([3, 3, 3])
    assert c.cycle_ms == pytest.approx([4.5, 4.5, 4.5]) and cycle_ms == pytest.approx(13.5)
    assert c.imgs_per_s() == pytest.approx(20 / 0.0135)  # timed images over summed cycle time
    assert c.step_rates() == pytest.approx([8 / 0.0045, 8 / 0.0045, 4 / 0.0045])
    resumed = clock.StepClock("cpu", warmup=2)
    resumed.load_state_dict(c.state_dict())
    assert resumed.imgs_per_s() == c.imgs_per_s() and resumed.process_steps == 0  # a resumed process warms up
    resumed.begin()
    for _ in range(3):
        with resumed.data(), resumed.compute():
            advance(2)
        resumed.step_done(8)
    resumed.end()
    assert resumed.timed_images == 28 and len(resumed.cycle_ms) == 4


class _FakeNVML:
    """pynvml as a MIG slice answers it: found by UUID only, no utilisation counter."""
    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0

    class NVMLError_NotSupported(Exception):
        pass

    def __init__(self):
        self.asked = []

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return f"index-{i}"  # NVML's PCI order: not necessarily the GPU training runs on

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.asked.append(uuid)
        if uuid != "GPU-5b2f0000-aaaa-bbbb-cccc-000000000001":
            raise KeyError(uuid)
        return "the-training-gpu"

    def nvmlDeviceGetUtilizationRates(self, h):
        raise self.NVMLError_NotSupported()

    def nvmlDeviceGetMemoryInfo(self, h):
        from types import SimpleNamespace
        return SimpleNamespace(used=2**30 if h == "the-training-gpu" else 0)

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1980

    def nvmlDeviceGetTemperature(self, h, kind):
        return 61

    def nvmlDeviceGetPowerUsage(self, h):
        return 612_000  # milliwatts


def test_the_sampler_asks_nvml_for_the_training_gpu_by_uuid_and_survives_a_missing_reading(monkeypatch):
    import sys
    import time

    from ampbench.measure import sysmon
    fake = _FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with sysmon.SystemMonitor(interval_s=0.02, gpu_uuid="5b2f0000-aaaa-bbbb-cccc-000000000001") as mon:
        time.sleep(0.3)
    assert len(mon.rows) >= 3  # the utilisation error did not stop the sampling thread
    row = mon.rows[-1]
    assert row["gpu_memory_used_bytes"] == 2**30  # the training GPU's, not NVML's index 0
    assert row["gpu_util_percent"] is None and "gpu_util_percent: NVMLError_NotSupported" in row["gpu_unavailable"]
    assert (row["gpu_sm_clock_mhz"], row["gpu_temperature_c"], row["gpu_power_w"]) == (1980, 61, 612.0)
    assert set(row) == set(sysmon.COLUMNS)
    s = sysmon.summary(mon.rows, imgs_per_s=3060.0)
    assert s["gpu_power_w_median"] == 612.0 and s["energy_per_image_j"] == pytest.approx(0.2)
    assert s["gpu_sm_clock_mhz_median"] == 1980


def test_a_24_hour_run_keeps_a_bounded_system_table_and_summarizes_every_sample():
    """Two samples a second for 24 hours: 172,800 samples. system.csv (and MLflow's points) keep at most
    MAX_ROWS rows spread over the whole run; the clock's spread, the median power and the energy per image are
    computed over every sample, as they would be with every row kept."""
    import tracemalloc

    from ampbench.measure import sysmon
    n = 24 * 3600 * 2
    mon = sysmon.SystemMonitor(interval_s=0.5)
    every = []

    def sample(i):
        busy = i % 10 != 0  # an evaluation every tenth sample: the GPU idles, its clock drops
        return {"t_s": i / 2, "process_cpu_percent": 100.0, "process_rss_bytes": 2**30,
                "system_memory_percent": 40.0, "gpu_util_percent": 95 if busy else 3,
                "gpu_memory_used_bytes": 2**33, "gpu_sm_clock_mhz": 1900 + i % 97 if busy else 600,
                "gpu_temperature_c": 60 + i % 7, "gpu_power_w": 400.0 + (i % 13) * 10 if busy else 90.0,
                "gpu_unavailable": None}
    tracemalloc.start()
    for i in range(n):
        mon.add(sample(i))
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert sysmon.MAX_ROWS // 2 <= len(mon.rows) < sysmon.MAX_ROWS
    assert mon.rows[0]["t_s"] == 0 and mon.rows[-1]["t_s"] > 0.99 * n / 2  # the whole run, evenly
    assert held < 16 * 2**20  # the rows and 8 bytes a sample of 4 readings: 5.8 MiB (every row kept: 58 MiB)
    every = [sample(i) for i in range(n)]
    full = sysmon.summary(every, 3000.0)
    assert sysmon.summary(mon.rows, 3000.0, mon.samples) == full
    assert full["gpu_sm_clock_mhz_p10_p90"][0] > 1900 and not math.isnan(full["energy_per_image_j"])


def test_the_clock_the_steadiness_guard_reads_is_the_timed_steps_alone():
    """An evaluation's boost clock and power (a busy GPU too) are not the timed steps' steady state: the samples
    carry the phase the training was in (set by the engine's loop) and the summary reads the timed ones."""
    from ampbench.measure import sysmon
    mon = sysmon.SystemMonitor(interval_s=0.5)
    for i in range(40):
        phase = ("warmup", "timed", "timed", "other")[i % 4]
        sysmon.set_phase(phase)
        mon.add({"t_s": i / 2, "phase": phase, "gpu_util_percent": 99, "gpu_temperature_c": 60,
                 "gpu_sm_clock_mhz": 1410 if phase == "timed" else 1980, "gpu_power_w": 700.0 if phase == "timed"
                 else 300.0})
    sysmon.set_phase("other")
    s = sysmon.summary(mon.rows, 7000.0, mon.samples)
    assert s["gpu_sm_clock_mhz_p10_p90"] == [1410, 1410] and s["gpu_sm_clock_mhz_median"] == 1410
    assert s["energy_per_image_j"] == pytest.approx(0.1) and sysmon.summary(mon.rows, 7000.0) == s
    assert "phase" in sysmon.COLUMNS


def test_step_clock_records_three_events_a_step_on_cuda_and_syncs_once(monkeypatch):
    """The step's data start is also the cycle's boundary, its data end the compute's start: three events a step
    (six, one per boundary, would double the host's per-step launch work), one sync when the window is read."""
    _FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: _FakeEvent.log.append("sync"))
    c = clock.StepClock("cuda", warmup=0)
    c.begin()
    for _ in range(4):
        with c.data():
            pass
        with c.compute():
            pass
        c.step_done(8)
    images, _ = c.end()
    assert _FakeEvent.log == ["record"] * (3 * 4 + 1) + ["sync"] and images == 32
    # each event is one tick of the fake clock: data 1, compute 1 (from the data's end), cycle 3 (data to data)
    assert c.data_ms == [1.0] * 4 and c.compute_ms == [1.0] * 4 and c.cycle_ms == [3.0] * 4


def test_a_sampler_hung_in_nvml_past_its_join_cannot_change_what_the_stage_summarizes(monkeypatch):
    """An NVML call that hangs keeps the sampling thread alive past the stage's join; when it returns, the thread
    appends a sample. The stage's snapshot, taken at the join, stays whole: its series the same length, summarized
    without a ValueError from zip(strict=True), and no sample added after it."""
    import sys
    import threading
    import time

    from ampbench.measure import sysmon
    fake, release, hung = _FakeNVML(), threading.Event(), threading.Event()
    clock = fake.nvmlDeviceGetClockInfo

    def hanging(h, kind):
        if hung.is_set():  # the second sample's clock read hangs until released
            release.wait(10)
        hung.set()
        return clock(h, kind)

    fake.nvmlDeviceGetClockInfo = hanging
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(sysmon.SystemMonitor, "JOIN_S", 0.05)
    with sysmon.SystemMonitor(interval_s=0.01, gpu_uuid="5b2f0000-aaaa-bbbb-cccc-000000000001") as mon:
        while not hung.is_set():
            time.sleep(0.01)
        time.sleep(0.1)
    rows, samples = mon.snapshot()
    release.set()  # the hung call returns: the thread adds its sample, or would
    mon._thread.join(5)
    assert not mon._thread.is_alive()
    assert len(rows) == len(mon.rows) and all(len(v) == len(samples["timed"]) for v in mon.samples.values())
    assert sysmon.summary(rows, 100.0, samples)["gpu_sm_clock_mhz_median"] == 1980


def test_activation_bytes_of_a_view_count_its_own_images_not_the_storage_it_views():
    """A batch is a view of its chunk (and a micro-batch of its batch): the first layer saves its input for backward,
    and counting the storage behind the view would charge a strict-fp32 pass the whole chunk."""
    from ampbench.train import probes
    from ampbench.train.policy import PrecisionPolicy
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(10))
    chunk = torch.randn(64, 3, 8, 8)
    policy = PrecisionPolicy("fp32", "cpu", None)
    alone = probes.activation_bytes(model, chunk[:8].clone(), policy)
    assert probes.activation_bytes(model, chunk[:8], policy) == alone
    assert alone < chunk.numel() * 4  # the 8 images' input and their feature maps, not the chunk's 64
