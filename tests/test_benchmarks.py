"""The benchmark scripts run end to end (a CPU smoke run; their numbers are not checked here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ampbench.sandbox import REPO_ROOT


def test_gpu_check_smoke_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--arch", "small_cnn",
         "--batch", "8", "--steps", "2", "--warmup", "1", "--repeats", "2", "--acc-epochs", "1",
         "--acc-images", "32", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"fp32_strict", "tf32", "fp16_amp", "bf16_amp", "fp16_amp_accum4"}
    assert rows["fp32_strict"]["vs_fp32"][0] == 1.0 and rows["fp16_amp"]["accuracy"] is not None
    assert "| fp16_amp_accum4 |" in proc.stdout
    page = out.with_suffix(".md").read_text()
    assert "| fp16_amp_accum4 |" in page and "gpu_check.py --device cpu" in page


def test_overhead_benchmark_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "overhead.py"), "--images", "256", "--batch", "32",
         "--rounds", "1", "--warmup", "1", "--target", "0"], capture_output=True, text=True, timeout=600)
    assert "ampbench/article's loop, like for like: median" in proc.stdout, proc.stderr[-3000:]
    assert "ampbench/fastest plain loop, like for like: median" in proc.stdout
    assert "heap: glibc malloc keeping freed memory" in proc.stdout or not sys.platform.startswith("linux")
    assert "minor page faults per run, median (max): article " in proc.stdout


HEAP_PROBE = """
import ctypes, resource, sys
import heap
if sys.argv[1] == "keep":
    print(heap.keep_freed_memory())
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20  # above glibc's largest mmap threshold: mmapped apart and unmapped when freed, by default

def touch():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)

touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()  # the same size again: the pages the first one freed, or fresh ones the kernel faults in and zeroes
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_benchmark_heap_keeps_freed_memory_so_a_later_loop_faults_no_pages_in():
    """overhead.py's heap setting: a block freed and asked for again comes back without page faults, where glibc's
    defaults unmap it and fault all its pages in again (16,384 of 4 KiB)."""
    def faults(mode: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", HEAP_PROBE, mode], cwd=REPO_ROOT / "benchmarks",
                             capture_output=True, text=True, timeout=60, check=True).stdout.split("\n")
        return [line for line in out if line]

    said, kept = faults("keep")
    assert said.startswith("glibc malloc keeping freed memory") and int(kept) < 100
    import resource
    from pathlib import Path
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not (thp.is_file() and "[always]" in thp.read_text()):  # 2 MiB pages would fault a few dozen times
        assert int(faults("default")[0]) >= 0.9 * (64 << 20) / resource.getpagesize()


def test_gpu_validate_lists_its_checks_on_a_cpu_and_refuses_to_run_there():
    listed = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_validate.py"), "--dry-run"],
                            capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr[-2000:]
    names = [line.split(":")[0] for line in listed.stdout.splitlines()]
    assert names == ["host_syncs", "steady_peak", "gpu_busy", "largest_batch", "tf32_getters", "stream", "nccl_ddp",
                     "fp8_gemms", "launch_floor", "host_work"]
    run = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_validate.py")], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0 and "no CUDA GPU" in run.stderr and "Traceback" not in run.stderr
    make = subprocess.run(["make", "-n", "gpu-validate"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert "PYTHONPATH=src python3 benchmarks/gpu_validate.py" in make.stdout and "pip" not in make.stdout


def test_gpu_validates_fp8_check_expects_what_cudas_rules_say(monkeypatch):
    """The fp8 GEMM check run with meta tensors in place of CUDA's (meta applies CUDA's _scaled_mm rules): it passes,
    and it fails where the rule it checks is not the one CUDA applies."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import gpu_validate
    finally:
        sys.path.pop(0)
    real_randn, real_ones = torch.randn, torch.ones
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(gpu_validate.torch, "randn", lambda *s, device=None: real_randn(*s, device="meta"))
    monkeypatch.setattr(gpu_validate.torch, "ones", lambda *s, device=None: real_ones(*s, device="meta"))
    monkeypatch.setattr(gpu_validate, "_rel_err", lambda out, ref: 0.0)  # a meta tensor holds no values
    done = gpu_validate.check_fp8_gemms({})
    assert done["passed"] is True, done
    # vit_tiny's MLP (192 -> 768 -> 192): 4 distinct GEMMs (one layer's forward is the other's input gradient)
    assert done["figure"]["batch 240"] == {"gemms": 4, "ran": 4, "refused": 0, "max_rel_err": 0.0}
    assert done["figure"]["batch 241"]["refused"] == 2  # the weight's gradient GEMM of each layer
    from ampbench.precision import linear
    monkeypatch.setattr(linear.LinearRung, "images_multiple", lambda self, census, device: 8)  # a wrong rule
    assert gpu_validate.check_fp8_gemms({})["passed"] is False


def test_input_pipeline_benchmark_runs_every_feed(tmp_path):
    out = tmp_path / "pipeline"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "input_pipeline.py"), "--images", "600", "--batch", "32",
         "--rounds", "1", "--workers", "1", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert list(rows) == ["device", "stream, memory", "stream, JPEG folder", "torchvision ImageFolder"]
    assert all(r[0]["imgs_per_s"] > 0 and 0 <= r[0]["data_share"] < 1 for r in rows.values())
    assert "| stream, JPEG folder |" in out.with_suffix(".md").read_text()


def _events(host_us: list[float], syncs_per_step: int = 0, gap: float = 10.0, more_at: int = -1) -> list:
    """Profiler events as torch.profiler's FunctionEvents give them: a ProfilerStep range per step (its CPU
    duration the host's time), and cudaStreamSynchronize calls inside where asked (one more in step ``more_at``)."""
    from types import SimpleNamespace as NS
    out, t = [], 0.0
    for i, us in enumerate(host_us):
        out.append(NS(name="ProfilerStep*", time_range=NS(start=t, end=t + us)))
        out += [NS(name="cudaStreamSynchronize", time_range=NS(start=t + 1 + k, end=t + 2 + k))
                for k in range(syncs_per_step + (i == more_at))]
        out.append(NS(name="cudaLaunchKernel", time_range=NS(start=t + 3, end=t + 4)))
        t += us + gap
    return out


def test_the_gpu_host_check_fails_an_engine_that_adds_a_sync_or_100us_a_step():
    """The launch-bound small CNN's step, about 1 ms of host work: the engine passes beside the plain loop at the
    same host time and syncs (fp16: GradScaler's one, both), and fails with one more sync a step, or 100 us more."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import host_profile
    finally:
        sys.path.pop(0)
    plain = _events([1000.0] * 30, syncs_per_step=1)
    same = host_profile.judge(_events([1010.0] * 30, syncs_per_step=1), plain)
    assert same["passed"] and same["figure"]["engine_over_plain"] == pytest.approx(1.01, abs=0.001)
    assert same["figure"]["plain_syncs_per_step"] == 1.0
    loss_read = host_profile.judge(_events([1010.0] * 30, syncs_per_step=1, more_at=20), plain)
    assert loss_read["passed"]  # the engine's loss read every 25 steps: one more sync in 30 steps is allowed
    synced = host_profile.judge(_events([1010.0] * 30, syncs_per_step=2), plain)
    assert not synced["passed"] and synced["figure"]["engine_syncs_per_step"] == 2.0
    slow = host_profile.judge(_events([1100.0] * 30, syncs_per_step=1), plain)
    assert not slow["passed"] and slow["figure"]["engine_over_plain"] == pytest.approx(1.1, abs=0.001)
    assert not host_profile.judge([], plain)["passed"]  # no step ranges: nothing measured, no pass
    from types import SimpleNamespace as NS
    step = NS(name="ProfilerStep*", time_range=NS(start=0.0, end=1000.0))
    wait = NS(name="cudaStreamSynchronize", time_range=NS(start=200.0, end=700.0))
    assert host_profile.host_per_step([step, wait]) == ([500.0], [1])  # a wait for the device is not host work
    on_gpu = NS(name="ProfilerStep*", time_range=NS(start=5.0, end=900.0), device_type=torch.autograd.DeviceType.CUDA)
    assert host_profile.host_per_step([step, on_gpu, wait]) == ([500.0], [1])  # the GPU timeline's copy: not the host's


def test_the_profilers_step_ranges_are_what_the_gpu_host_check_reads():
    """On the CPU, torch.profiler's own events for a loop with prof.step(): one ProfilerStep range per active step,
    each with a positive duration (the form the faked events above copy)."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import host_profile
    finally:
        sys.path.pop(0)
    x = torch.ones(64, 64)
    schedule = torch.profiler.schedule(wait=0, warmup=2, active=4, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule) as prof:
        for _ in range(6):
            x = x @ x / 64
            prof.step()
    host, syncs = host_profile.host_per_step(list(prof.events()))
    assert len(host) == 4 and all(us > 0 for us in host) and syncs == [0, 0, 0, 0]


def test_the_aa_benchmark_counts_every_claim_of_a_twin_as_false():
    """paired_aa: a "faster" or "slower" of the identical twin or of tf32 (fp32's arithmetic on a CPU) is false;
    the row gives the count, the rate and its exact 95% upper bound."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import paired_aa
    finally:
        sys.path.pop(0)
    said = paired_aa.false_claims({"vs_fp32": {"fp32_twin": {"claim": "faster"}, "tf32": {"claim": None}}})
    assert said == {"fp32_twin": "faster", "tf32": None}
    assert paired_aa.false_claims({"vs_fp32": {}}) == {"fp32_twin": None, "tf32": None}  # not timed: no claim
    runs = [said] + [{"fp32_twin": None, "tf32": "slower"}] + [{"fp32_twin": None, "tf32": None}] * 98
    assert paired_aa.row("quiet", runs) == "| quiet | 100 | 200 | 2 (fp32_twin 1, tf32 1) | 1.0% | 3.6% |"
