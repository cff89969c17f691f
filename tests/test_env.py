"""The environment probe and the device decision."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import yaml

from ampbench import env
from ampbench.errors import EnvironmentMismatch
from ampbench.sandbox import REPO_ROOT

CPU_INFO = {"cuda_available": False, "torch": "2.x", "cuda_runtime": None, "gpu": None}


def _gpu(**kw):
    gpu = {"name": "NVIDIA GeForce RTX 4090", "capability": "8.9", "driver": "550.54", "tensor_cores": True,
           "bf16_supported": True, "tf32_capable": True}
    gpu.update(kw)
    return {"cuda_available": True, "torch": "2.x", "cuda_runtime": "12.4", "gpu": gpu}


def test_probe_is_deterministic():
    assert env.probe() == env.probe()
    info = env.probe()
    for key in ("torch", "cpu_model", "cpu_count", "cuda_available", "cudnn", "gpu"):
        assert key in info


def test_auto_without_cuda_stops_with_the_remedy():
    with pytest.raises(EnvironmentMismatch) as err:
        env.resolve_device("auto", CPU_INFO, {"fp32", "fp16"})
    msg = str(err.value)
    assert "emulated" in msg and "make demo" in msg and "device: cpu" in msg


def test_cuda_requested_without_cuda_is_an_error():
    with pytest.raises(EnvironmentMismatch, match="device = 'cuda'"):
        env.resolve_device("cuda", CPU_INFO, {"fp32"})


def test_cpu_and_cuda_resolve():
    assert env.resolve_device("cpu", CPU_INFO, {"fp16"}) == "cpu"
    assert env.resolve_device("auto", _gpu(), {"fp16", "bf16"}) == "cuda"
    with pytest.raises(EnvironmentMismatch, match="no native bf16"):
        env.resolve_device("auto", _gpu(bf16_supported=False, capability="7.0"), {"bf16"})


def test_warnings_for_old_driver_and_no_tensor_cores():
    assert env.warnings_for(_gpu()) == []
    assert any("no tensor cores" in w for w in env.warnings_for(_gpu(tensor_cores=False, capability="6.1")))
    assert any("emulated" in w for w in env.warnings_for(CPU_INFO))


def test_set_tf32_flags_and_every_getter_stays_readable():
    """torch reads its TF32 state through old and new getters (inductor with train.compile, users' factories):
    none may raise after ampbench sets the flags, in either mode and back."""
    from ampbench import precision
    for allow in (False, True, False):
        mode = "tf32" if allow else "ieee"
        assert precision.set_tf32(allow) == {"matmul_fp32_precision": mode, "cudnn_conv_fp32_precision": mode}
        assert torch.backends.cudnn.allow_tf32 is allow and torch.backends.cuda.matmul.allow_tf32 is allow
        assert torch.get_float32_matmul_precision() == ("high" if allow else "highest")
        assert torch.backends.cuda.matmul.fp32_precision == mode
        assert torch.backends.cudnn.conv.fp32_precision in (mode, "none")  # "none": cuDNN's own flag decides


def _env_check(tmp_path, params: dict | str):
    p = tmp_path / "params.yaml"
    p.write_text(params if isinstance(params, str) else yaml.safe_dump(params))
    (tmp_path / "reports").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, str(REPO_ROOT / "stages" / "env_check.py"), "--params", str(p),
                           "--env", str(tmp_path / "reports" / "env.json"), "--plans",
                           str(tmp_path / "reports" / "plans"), "--data-source",
                           str(tmp_path / "reports" / "data_source.json"), "--model-source",
                           str(tmp_path / "reports" / "model_source.json"), "--roofline",
                           str(tmp_path / "reports" / "roofline.json")],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(env.probe()["cuda_available"], reason="this machine has CUDA")
def test_env_check_stage_stops_on_a_cpu_with_device_auto(tmp_path, real_params):
    proc = _env_check(tmp_path, real_params)
    assert proc.returncode == 2
    assert "make demo" in proc.stderr and "Traceback" not in proc.stderr
    assert list((tmp_path / "reports").iterdir()) == []


@pytest.mark.parametrize(("text", "words"), [
    ("train: {batch_size: -4}\n", "train.batch_size = -4"),
    ("variants: {amp: {precision: fp64}}\n", "variants.amp.precision = 'fp64'"),
    ("train:\n  epochs: [\n", "broken YAML"),
])
def test_env_check_stage_bad_params_exit_2_one_line_nothing_written(tmp_path, text, words):
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "env.json").write_text("{}\n")
    proc = _env_check(tmp_path, text)
    assert proc.returncode == 2
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert (tmp_path / "reports" / "env.json").read_text() == "{}\n"
    assert not (tmp_path / "reports" / "plans").exists()


def test_env_check_stage_cpu_writes_env_and_plans(tmp_path, tiny_params):
    proc = _env_check(tmp_path, tiny_params)
    assert proc.returncode == 0, proc.stderr
    assert "warning:" in proc.stdout
    plans = sorted(p.name for p in (tmp_path / "reports" / "plans").iterdir())
    assert plans == ["amp.json", "amp_accum.json", "fp32.json", "tf32.json"]
    first = (tmp_path / "reports" / "env.json").read_bytes()
    _env_check(tmp_path, tiny_params)
    assert (tmp_path / "reports" / "env.json").read_bytes() == first


def _fake_gpu(monkeypatch, name: str, cap: tuple[int, int], arch_list: list[str]) -> dict:
    """env.probe() on a machine whose torch.cuda reports one GPU ``name`` of capability ``cap``."""
    from types import SimpleNamespace
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name=name, total_memory=16 * 2**30, multi_processor_count=40))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: cap)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: cap >= (8, 0))
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: arch_list)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    monkeypatch.setattr(env.machine, "_driver_version", lambda: "580.65")
    return env.probe()


CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # what the cu130 wheel carries


@pytest.mark.parametrize(("name", "cap", "runs", "tensor_cores"), [
    ("Tesla V100-SXM2-16GB", (7, 0), False, True),    # sm_70: no kernels in the cu130 wheel
    ("Tesla P100-PCIE-16GB", (6, 0), False, False),
    ("NVIDIA GeForce RTX 4090", (8, 9), True, True),  # sm_89 runs the sm_86 kernels
    ("NVIDIA L40S", (8, 9), True, True),
    ("NVIDIA GeForce GTX 1660 Ti", (7, 5), True, False),  # Turing without tensor cores
    ("NVIDIA H200", (9, 0), True, True),
])
def test_a_gpu_the_torch_build_has_no_kernels_for_is_refused_by_env_check(monkeypatch, name, cap, runs,
                                                                           tensor_cores):
    info = _fake_gpu(monkeypatch, name, cap, CU130)
    assert info["gpu"]["kernels"] is runs and info["gpu"]["tensor_cores"] is tensor_cores
    if runs:
        assert env.resolve_device("auto", info, {"fp32", "fp16"}) == "cuda"
    else:
        with pytest.raises(EnvironmentMismatch) as err:
            env.resolve_device("auto", info, {"fp32", "fp16"})
        assert f"sm_{cap[0]}{cap[1]}" in str(err.value) and "sm_75, sm_80" in str(err.value)
        assert "install a torch build" in str(err.value)


def _fake_nvidia_smi(tmp_path, monkeypatch, driver: str) -> None:
    """An nvidia-smi on PATH that answers the driver query as a real one does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{driver}'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


@pytest.mark.parametrize(("cuda", "driver", "needed"), [("13.0", "550.54.15", "580.65.06"),
                                                        ("12.8", "470.256.02", "525.60.13")])
def test_a_driver_too_old_for_the_torch_build_is_named_with_the_fix(tmp_path, monkeypatch, cuda, driver, needed):
    """torch sees no GPU (the driver is older than its CUDA build needs) while nvidia-smi shows one: env_check says
    so, with the driver's version, the one needed, and how to install a torch for an older CUDA."""
    _fake_nvidia_smi(tmp_path, monkeypatch, driver)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    info = env.probe()
    assert info["driver"] == driver and info["gpu"] is None
    with pytest.raises(EnvironmentMismatch) as err:
        env.resolve_device("auto", info, {"fp32", "fp16"})
    msg = str(err.value)
    assert f"driver {driver}" in msg and f"CUDA {cuda}" in msg and f"needs driver {needed} or later" in msg
    assert "make install TORCH_INDEX=" in msg and "found no CUDA GPU" not in msg
    assert env.resolve_device("cpu", info, {"fp32"}) == "cpu"  # device: cpu still runs


def test_a_new_enough_driver_without_a_usable_gpu_gets_the_no_gpu_message(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, "580.82.07")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(EnvironmentMismatch, match="found no CUDA GPU"):
        env.resolve_device("auto", env.probe(), {"fp32"})


def test_the_makefile_installs_torch_from_another_index_when_asked():
    dry = subprocess.run(["make", "-n", "-B", ".venv/.installed", "TORCH_INDEX=https://example.invalid/cu126"],
                         cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    assert "--index-url https://example.invalid/cu126 torch==2.14.1 torchvision==0.29.1" in dry
    assert "requirements-without-torch.txt" in dry


def test_ptx_in_the_build_runs_on_newer_gpus():
    assert env.has_kernels((12, 1), ["sm_90", "compute_90"])  # PTX JIT-compiled for a newer GPU
    assert not env.has_kernels((12, 1), ["sm_90"]) and not env.has_kernels((8, 0), ["sm_90", "compute_90"])
