"""Model FLOPs per image (torch.utils.flop_counter) and datasheet peaks, for achieved TFLOP/s.

The peaks are NVIDIA's datasheet figures for dense tensor math (no sparsity),
in TFLOP/s; they are quoted, not measured, and labelled so in the report.
"""

from __future__ import annotations

import copy
import re

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

# name pattern -> {precision: datasheet dense TFLOP/s}; fp32 means plain (non-tensor-core) FP32.
DATASHEET_PEAKS = [
    (r"H200", {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4}),
    (r"H100.*(SXM|HBM3)", {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4}),
    (r"H100", {"fp32": 51.2, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0}),  # PCIe
    (r"A100", {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}),
    (r"V100", {"fp32": 15.7, "fp16": 125.0}),
    (r"\bT4\b", {"fp32": 8.1, "fp16": 65.0}),
    (r"\bL4\b", {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0}),
    (r"RTX 4090", {"fp32": 82.6, "tf32": 82.6, "fp16": 165.2, "bf16": 165.2}),
]


def datasheet_peak(gpu_name: str | None, precision: str) -> float | None:
    """The datasheet dense peak (TFLOP/s) in column ``precision`` (``precision.datasheet_column``), if known."""
    if not gpu_name:
        return None
    for pattern, peaks in DATASHEET_PEAKS:
        if re.search(pattern, gpu_name):
            return peaks.get(precision)
    return None


def train_flops_per_image(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """FLOPs of one forward + backward per image, counted in fp32 on a copy of the model."""
    probe = copy.deepcopy(model).float().train()
    counter = FlopCounterMode(display=False)
    with counter:
        loss = F.cross_entropy(probe(x.float()), y)
        loss.backward()
    return counter.get_total_flops() / len(y)
