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


def _row(fp32, tf32, fp16, fp8, bandwidth_gbps, bf16="fp16") -> dict:
    return {"fp32": fp32, "tf32": tf32, "fp16": fp16, "bf16": fp16 if bf16 == "fp16" else bf16, "fp8": fp8,
            "bandwidth_gbps": bandwidth_gbps}


# name pattern (first match wins: the specific before the general) -> dense TFLOP/s and GB/s
DATASHEET = [
    # NVIDIA B200 (HGX B200 / DGX B200 datasheet, per GPU: 600 TF FP32, 18 PF TF32*, 36 PF FP16*, 72 PF FP8* for 8)
    (r"\bB200\b", _row(75.0, 1125.0, 2250.0, 4500.0, 8000)),
    # NVIDIA H200 NVL and H200 SXM (H200 Tensor Core GPU datasheet)
    (r"H200 NVL", _row(60.0, 417.5, 835.5, 1670.5, 4800)),
    (r"H200", _row(67.0, 494.7, 989.4, 1978.9, 4800)),
    # NVIDIA H100 NVL, SXM5 and PCIe (H100 Tensor Core GPU datasheet)
    (r"H100 NVL", _row(60.0, 417.5, 835.5, 1670.5, 3900)),
    (r"H100.*(SXM|HBM3)", _row(67.0, 494.7, 989.4, 1978.9, 3350)),
    (r"H100", _row(51.2, 378.0, 756.0, 1513.0, 2000)),  # PCIe
    # NVIDIA A100 (A100 Tensor Core GPU datasheet; 80GB SXM: 2,039 GB/s, 40GB: 1,555 GB/s)
    (r"A100 80GB PCIe", _row(19.5, 156.0, 312.0, None, 1935)),
    (r"A100.*80GB", _row(19.5, 156.0, 312.0, None, 2039)),
    (r"A100", _row(19.5, 156.0, 312.0, None, 1555)),
    # NVIDIA L40S, L4 (L40S and L4 Tensor Core GPU datasheets); A40, A10 (A40 and A10 datasheets)
    (r"L40S", _row(91.6, 183.0, 362.05, 733.0, 864)),
    (r"\bL4\b", _row(30.3, 60.0, 121.0, 242.5, 300)),
    (r"\bA40\b", _row(37.4, 74.8, 149.7, None, 696)),
    (r"\bA10\b", _row(31.2, 62.5, 125.0, None, 600)),
    # NVIDIA V100, T4 (V100 and T4 datasheets: mixed-precision FP16 tensor cores, no TF32 or BF16)
    (r"V100", _row(15.7, None, 125.0, None, 900, bf16=None)),
    (r"\bT4\b", _row(8.1, None, 65.0, None, 320, bf16=None)),
    # GeForce (NVIDIA RTX Blackwell, Ada and Ampere GA102 architecture whitepapers, FP32-accumulate rates)
    (r"RTX 5090", _row(104.8, 104.8, 209.5, 419.0, 1792)),
    (r"RTX 4090", _row(82.6, 82.6, 165.2, 330.3, 1008)),
    (r"RTX 3090(?! Ti)", _row(35.6, 35.6, 71.0, None, 936)),
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
