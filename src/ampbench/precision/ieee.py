"""fp32 and tf32: no autocast, no scaler.

- fp32: strict IEEE fp32, TF32 off for matmuls and convolutions.
- tf32: fp32 weights and activations, matmuls and convolutions on TF32 tensor cores (10-bit mantissa): what
  ``torch.set_float32_matmul_precision("high")`` with cuDNN's default gives. PyTorch's own default is TF32
  convolutions with IEEE matmuls. On a CPU, or a GPU before Ampere, tf32 is fp32.
"""

from __future__ import annotations

from ampbench.precision import Rung

RUNGS = [
    Rung("fp32", "FP32"),
    Rung("tf32", "TF32", tf32=True, datasheet="tf32"),
]
