"""fp16 and bf16: ``torch.amp.autocast`` to a 16-bit float.

- fp16: autocast to float16 plus ``torch.amp.GradScaler``, because fp16's narrow range (6e-8 .. 65504) lets small
  gradients underflow to zero. A CPU has no fp16 tensor cores: autocast to fp16 is emulated there.
- bf16: autocast to bfloat16 with no scaler: bf16 has fp32's exponent range; needs a GPU with native bf16.
"""

from __future__ import annotations

from ampbench.precision import Rung

RUNGS = [
    Rung("fp16", "FP16-AMP", autocast="float16", grad_scaler=True, datasheet="fp16", emulated_on_cpu=True),
    Rung("bf16", "BF16-AMP", autocast="bfloat16", datasheet="bf16", gate="bf16_supported",
         gate_fix="remove that variant or use fp16"),
]
