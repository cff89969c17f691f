"""The environment probe: what this machine can run, and whether it fits params.yaml.

``probe()`` returns a deterministic description of the hardware and software
(no timestamps, no free-memory readings), so that ``reports/env.json`` changes
only when the machine really changed. ``resolve_device()`` decides where the
comparison runs, or stops it with the reason and the remedy.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import torch

from ampbench import precision
from ampbench.config import resolve_backend
from ampbench.errors import EnvironmentMismatch
from ampbench.results.schema import Env

# The oldest Linux driver each CUDA major version runs on (NVIDIA's CUDA Toolkit release notes, "CUDA Toolkit and
# Corresponding Driver Versions", minor version compatibility): a torch wheel built for CUDA 13.0 needs r580.
MIN_DRIVER_FOR_CUDA = {13: (580, 65, 6), 12: (525, 60, 13), 11: (450, 80, 2)}
# A torch build for an older CUDA, for a machine whose driver is too old: the Makefile installs it this way.
OLDER_TORCH = "rm -rf .venv && make install TORCH_INDEX=https://download.pytorch.org/whl/cu126"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver_version() -> str | None:
    """The NVIDIA driver version, from nvidia-smi when it is on PATH."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def min_driver(cuda: str | None) -> tuple[int, ...] | None:
    """The oldest driver that runs a torch build for CUDA ``cuda`` (torch.version.cuda), if known."""
    if not cuda:
        return None
    return MIN_DRIVER_FOR_CUDA.get(_version_tuple(cuda)[0])


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(f"{v:02d}" if i == 2 else str(v) for i, v in enumerate(version))


PROBE_OVERRIDE_ENV = "AMPBENCH_PROBE_OVERRIDE"  # JSON merged into probe(): a clone presenting another machine (tests)


def probe() -> Env:
    """Describe this machine's accelerator, software and CPU (deterministic); ``$AMPBENCH_PROBE_OVERRIDE`` (a JSON
    object) replaces what it names, so a test's clones can present different machines through DVC's stages."""
    info = _probe()
    override = os.environ.get(PROBE_OVERRIDE_ENV)
    if override:
        try:
            info.update(json.loads(override))
        except (ValueError, TypeError) as err:
            raise EnvironmentMismatch(f"{PROBE_OVERRIDE_ENV} = {override!r} is not a JSON object ({err}); unset it") \
                from None
    return info


def _probe() -> Env:
    info: Env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "tf32_defaults": precision.tf32_flags(),  # before ampbench sets them: what a plain "fp32" run here would use
        "gpu": None,
        "driver": _driver_version(),  # from nvidia-smi: there even when torch cannot use the GPU
    }
    if info["cuda_available"]:
        idx = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        cap = torch.cuda.get_device_capability(idx)
        info["gpu"] = {
            "name": props.name,
            "count": torch.cuda.device_count(),
            "capability": f"{cap[0]}.{cap[1]}",
            "total_memory_bytes": props.total_memory,
            "multiprocessors": props.multi_processor_count,
            "driver": info["driver"],
            "tensor_cores": has_tensor_cores(props.name, cap),
            "fp16_tensor_cores": has_tensor_cores(props.name, cap),
            "arch_list": torch.cuda.get_arch_list(),  # the architectures this torch build carries kernels for
            "kernels": has_kernels(cap, torch.cuda.get_arch_list()),
            "bf16_supported": torch.cuda.is_bf16_supported(including_emulation=False),
            "tf32_capable": cap >= (8, 0),           # Ampere and later
            "fp8_supported": cap >= (8, 9),          # fp8 tensor cores: Ada, Hopper, Blackwell
        }
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
        info["nccl"] = list(nccl) if isinstance(nccl, tuple) else nccl
    return info


def has_tensor_cores(name: str, cap: tuple[int, int]) -> bool:
    """Volta (sm_70) and later have tensor cores, except Turing's GeForce GTX 16xx (sm_75 without them)."""
    return cap >= (7, 0) and not re.search(r"GTX 16\d\d", name)


def has_kernels(cap: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a torch build carrying ``arch_list`` runs on a GPU of capability ``cap``, by torch's rule: an
    ``sm_`` entry of the same major version and a minor no higher than the device's (an sm_89 RTX 4090 runs
    sm_86 kernels), or a ``compute_`` (PTX) entry no newer than the device. An empty list (a build that does not
    say) is taken to run."""
    sms = [int(m.group(1)) for a in arch_list if (m := re.fullmatch(r"sm_(\d+)[af]?", a))]
    ptx = [int(m.group(1)) for a in arch_list if (m := re.fullmatch(r"compute_(\d+)[af]?", a))]
    if not arch_list:
        return True
    device = 10 * cap[0] + cap[1]
    return (any(sm // 10 == cap[0] and sm % 10 <= cap[1] for sm in sms)
            or any(p <= device for p in ptx))  # PTX is compiled for the device when it loads


def warnings_for(info: dict) -> list[str]:
    """Human warnings about this environment (old driver, no tensor cores, CPU run)."""
    out = []
    gpu = info.get("gpu")
    if gpu is None:
        out.append("no CUDA GPU: fp16 autocast on a CPU is emulated and slower than fp32; "
                   "the numbers describe this CPU, not what fp16 buys on a GPU")
        return out

    if not gpu["tensor_cores"]:
        out.append(f"{gpu['name']} (compute capability {gpu['capability']}) has no tensor cores: "
                   "fp16 will save memory but will not run much faster than fp32")
    from ampbench.measure.flops import datasheet_row
    if "MIG" not in gpu["name"] and datasheet_row(gpu["name"]) is None:
        out.append(f"{gpu['name']} is not in the datasheet table (a laptop, D or Grace part is not its namesake's "
                   "row): the report's roofline and share-of-peak figures are n/a for it (`ampbench roofline --gpu` "
                   "lists the cards the table holds)")
    return out


def resolve_device(requested: str, info: dict, precisions: set[str]) -> str:
    """Return ``cuda`` or ``cpu`` for ``device: auto|cuda|cpu``, or stop with the remedy."""
    has_cuda = info["cuda_available"]
    driver, needed = info.get("driver"), min_driver(info.get("cuda_runtime"))
    if requested in ("auto", "cuda") and not has_cuda and driver and needed and _version_tuple(driver) < needed:
        raise EnvironmentMismatch(
            f"nvidia-smi shows a GPU with NVIDIA driver {driver}, too old for this torch {info['torch']} built for "
            f"CUDA {info['cuda_runtime']} (it needs driver {_dotted(needed)} or later), so torch cannot use the GPU; "
            f"update the driver, or install a torch build for an older CUDA: {OLDER_TORCH} (docs/troubleshooting.md: "
            "an older NVIDIA driver)")
    if requested == "cuda" and not has_cuda:
        raise EnvironmentMismatch(
            "params.yaml: device = 'cuda' but torch sees no CUDA GPU here "
            f"(torch {info['torch']}, CUDA runtime {info['cuda_runtime']}); "
            "check nvidia-smi and the driver, or set device: cpu to run on the CPU")
    if requested == "auto" and not has_cuda:
        raise EnvironmentMismatch(
            "params.yaml: device = 'auto' found no CUDA GPU. fp16 on a CPU is emulated and slower than "
            "fp32, so the comparison would mislead. Run the CPU demo instead (make demo), "
            "or set device: cpu in params.yaml to force the CPU run")
    device = "cuda" if requested in ("auto", "cuda") else "cpu"
    gpu = info["gpu"]
    if device == "cuda" and gpu and not gpu.get("kernels", True):
        raise EnvironmentMismatch(
            f"{gpu['name']} (compute capability {gpu['capability']}, sm_{gpu['capability'].replace('.', '')}) has "
            f"no kernels in this torch {info['torch']} build, which carries {', '.join(gpu['arch_list'])}; "
            "install a torch build that lists your GPU's architecture (torch.cuda.get_arch_list()), or run on "
            "another GPU")
    for name in sorted(precisions) if device == "cuda" else ():
        reason = precision.unsupported(name, info["gpu"])
        if reason:
            raise EnvironmentMismatch(reason)
    return device


VALIDATED = Path("benchmarks") / "results" / "gpu_validate" / "results.json"  # make gpu-validate's record


def validated_recipes(info: dict, root: Path | None = None) -> set[str]:
    """The fp8 recipes whose GEMM `make gpu-validate` ran on this machine's GPU (by name), as its record in the
    repository (``root``, the working directory by default) says; none without one."""
    try:
        found = json.loads(((root or Path.cwd()) / VALIDATED).read_text())
    except (OSError, ValueError):
        return set()
    if ((found.get("env") or {}).get("gpu") or {}).get("name") != (info.get("gpu") or {}).get("name"):
        return set()
    figure = (((found.get("checks") or {}).get("fp8_gemms") or {}).get("figure") or {})
    return {r for r, ran in (figure.get("recipes") or {}).items() if ran is True}


def check_recipes(device: str, info: dict, plans: dict, root: Path | None = None) -> None:
    """Stop before anything starts when a variant's recipe cannot be trusted on this GPU (``plans``: variant ->
    RunPlan), with the fix."""
    if device != "cuda" or not info.get("gpu"):
        return
    validated = validated_recipes(info, root)
    for name, plan in sorted(plans.items()):
        reason = precision.rung(plan.precision).gpu_refuses(plan.recipe, info["gpu"], validated)
        if reason:
            raise EnvironmentMismatch(f"params.yaml: variants.{name}: {reason}")


def check_distributed(cfg, device: str, info: dict, grad_comms: set[str]) -> None:
    """Stop before anything starts when the distributed section cannot run here (``cfg``: DistributedConfig).

    ``grad_comms``: the gradient communications the variants that train under DDP ask for.
    """
    nproc = cfg.nproc_per_node
    if cfg.backend == "nccl" and device != "cuda":
        raise EnvironmentMismatch("params.yaml: distributed.backend = 'nccl' needs CUDA GPUs and this run is on the "
                                  "CPU; set distributed.backend: gloo (or auto)")
    if device == "cuda" and info["gpu"] and nproc > info["gpu"]["count"]:
        raise EnvironmentMismatch(
            f"params.yaml: distributed.nproc_per_node = {nproc} but this machine has {info['gpu']['count']} "
            f"CUDA GPU(s) ({info['gpu']['name']}); start at most one process per GPU: set "
            f"distributed.nproc_per_node: {info['gpu']['count']}")
    if device == "cpu" and nproc > (info.get("cpu_count") or 1):
        raise EnvironmentMismatch(f"params.yaml: distributed.nproc_per_node = {nproc} but this machine has "
                                  f"{info.get('cpu_count')} CPU cores; set at most that many processes")
    if resolve_backend(cfg, device) == "nccl" and "bf16" in grad_comms:
        nccl = info.get("nccl")
        if nccl and tuple(nccl) < (2, 10):
            raise EnvironmentMismatch(f"grad_comm bf16 needs NCCL 2.10 or later and this torch has NCCL "
                                      f"{'.'.join(map(str, nccl))}; use grad_comm: fp16 or none")
        if info["gpu"] and not info["gpu"]["bf16_supported"]:
            raise EnvironmentMismatch(f"grad_comm bf16 needs a GPU with bf16 and {info['gpu']['name']} (compute "
                                      f"capability {info['gpu']['capability']}) has none; use grad_comm: fp16")
