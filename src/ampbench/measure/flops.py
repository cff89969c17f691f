"""Model FLOPs per image (torch.utils.flop_counter), and the one table of what each GPU could give at most.

``DATASHEET``: per GPU, NVIDIA's datasheet figures for dense math (no sparsity: the datasheets' starred
figures are halved), in TFLOP/s: plain FP32 (no tensor cores), TF32, FP16/BF16 and FP8 tensor cores, each with
FP32 accumulation (GeForce cards run FP16 and FP8 with FP32 accumulation at half their FP16-accumulation rate;
these rows hold the FP32-accumulation rate, which is what torch's autocast uses), and memory bandwidth in GB/s
(the roofline's other axis). None: the GPU has no such tensor core. The figures are quoted, not measured, and the
report labels them so. A MIG slice matches no row: its share of the GPU's peak is not its share of the name.
"""

from __future__ import annotations

import copy
import re

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

COLUMNS = ("fp32", "tf32", "fp16", "bf16", "fp8", "bandwidth_gbps")


def _row(name, source, fp32, tf32, fp16, fp8, bandwidth_gbps, bf16="fp16") -> dict:
    return {"name": name, "source": source, "fp32": fp32, "tf32": tf32, "fp16": fp16,
            "bf16": fp16 if bf16 == "fp16" else bf16, "fp8": fp8, "bandwidth_gbps": bandwidth_gbps}


_HOPPER = "NVIDIA H100 Tensor Core GPU datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM: 2,039 GB/s; 40GB: 1,555 GB/s)"
_BLACKWELL = "NVIDIA RTX Blackwell GPU architecture whitepaper (FP32-accumulate tensor rates)"
_ADA = "NVIDIA Ada GPU architecture whitepaper (FP32-accumulate tensor rates)"
_AMPERE = "NVIDIA Ampere GA102 GPU architecture whitepaper (FP32-accumulate tensor rates)"

# name pattern (first match wins: the specific before the general) -> name, cited source, dense TFLOP/s, GB/s
DATASHEET = [
    (r"\bB200\b", _row("B200", "NVIDIA HGX B200 datasheet, per GPU (600 TF FP32, 18 PF TF32*, 36 PF FP16*, "
                        "72 PF FP8* for 8)", 75.0, 1125.0, 2250.0, 4500.0, 8000)),
    (r"H200 NVL", _row("H200 NVL", _H200, 60.0, 417.5, 835.5, 1670.5, 4800)),
    (r"H200", _row("H200", _H200 + " (SXM)", 67.0, 494.7, 989.4, 1978.9, 4800)),
    (r"H100 NVL", _row("H100 NVL", _HOPPER, 60.0, 417.5, 835.5, 1670.5, 3900)),
    (r"H100.*(SXM|HBM3)", _row("H100 SXM", _HOPPER + " (SXM5)", 67.0, 494.7, 989.4, 1978.9, 3350)),
    (r"H100", _row("H100 PCIe", _HOPPER + " (PCIe)", 51.2, 378.0, 756.0, 1513.0, 2000)),
    (r"A100 80GB PCIe", _row("A100 80GB PCIe", _A100, 19.5, 156.0, 312.0, None, 1935)),
    (r"A100.*80GB", _row("A100 80GB SXM", _A100, 19.5, 156.0, 312.0, None, 2039)),
    (r"A100", _row("A100 40GB", _A100, 19.5, 156.0, 312.0, None, 1555)),
    (r"L40S", _row("L40S", "NVIDIA L40S datasheet", 91.6, 183.0, 362.05, 733.0, 864)),
    (r"\bL4\b", _row("L4", "NVIDIA L4 Tensor Core GPU datasheet", 30.3, 60.0, 121.0, 242.5, 300)),
    (r"\bA40\b", _row("A40", "NVIDIA A40 datasheet", 37.4, 74.8, 149.7, None, 696)),
    (r"\bA10\b", _row("A10", "NVIDIA A10 datasheet", 31.2, 62.5, 125.0, None, 600)),
    # mixed-precision FP16 tensor cores, no TF32 or BF16
    (r"V100", _row("V100", "NVIDIA V100 Tensor Core GPU datasheet", 15.7, None, 125.0, None, 900, bf16=None)),
    (r"\bT4\b", _row("T4", "NVIDIA T4 datasheet", 8.1, None, 65.0, None, 320, bf16=None)),
    (r"RTX 5090", _row("RTX 5090", _BLACKWELL, 104.8, 104.8, 209.5, 419.0, 1792)),
    (r"RTX 4090", _row("RTX 4090", _ADA, 82.6, 82.6, 165.2, 330.3, 1008)),
    (r"RTX 3090(?! Ti)", _row("RTX 3090", _AMPERE, 35.6, 35.6, 71.0, None, 936)),
]


def datasheet_row(gpu_name: str | None) -> dict | None:
    """The datasheet row of ``gpu_name`` (torch's device name), or None: unknown, or a MIG slice."""
    if not gpu_name or "MIG" in gpu_name:
        return None
    return next((row for pattern, row in DATASHEET if re.search(pattern, gpu_name)), None)


def datasheet_peak(gpu_name: str | None, precision: str) -> float | None:
    """The dense peak (TFLOP/s) in column ``precision`` (``precision.datasheet_column``), if known."""
    row = datasheet_row(gpu_name)
    return row.get(precision) if row else None


def memory_bandwidth_gbps(gpu_name: str | None) -> float | None:
    """The datasheet memory bandwidth (GB/s), if known."""
    row = datasheet_row(gpu_name)
    return row["bandwidth_gbps"] if row else None


def train_flops_per_image(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """FLOPs of one forward + backward per image, counted in fp32 on a copy of the model."""
    probe = copy.deepcopy(model).float().train()
    counter = FlopCounterMode(display=False)
    with counter:
        loss = F.cross_entropy(probe(x.float()), y)
        loss.backward()
    return counter.get_total_flops() / len(y)
