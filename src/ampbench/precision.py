"""The precision policy: the one place that knows what fp32, fp16 and bf16 mean.

- fp32: no autocast, no scaler.
- fp16: ``torch.amp.autocast`` to float16 plus ``torch.amp.GradScaler``, because
  fp16's narrow range (6e-8 .. 65504) lets small gradients underflow to zero.
- bf16: autocast to bfloat16 with no scaler: bf16 has fp32's exponent range.

The engine asks the policy for an autocast context and a scaler; a disabled
scaler is a no-op, so the loop has a single code path for every precision.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from ampbench.config import AmpConfig

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    precision: str          # fp32 | fp16 | bf16
    device_type: str        # cuda | cpu
    amp: AmpConfig | None   # GradScaler settings, used only for fp16

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def uses_autocast(self) -> bool:
        return self.precision != "fp32"

    @property
    def uses_scaler(self) -> bool:
        return self.precision == "fp16"

    def autocast(self) -> AbstractContextManager:
        """The forward-pass context: autocast to fp16/bf16, or a disabled one for fp32."""
        return torch.autocast(self.device_type, dtype=self.dtype if self.uses_autocast else None,
                              enabled=self.uses_autocast)

    def scaler(self) -> torch.amp.GradScaler:
        """A GradScaler from params.yaml's ``amp`` section; disabled (a no-op) unless fp16."""
        if not self.uses_scaler:
            return torch.amp.GradScaler(self.device_type, enabled=False)
        a = self.amp or AmpConfig()
        return torch.amp.GradScaler(self.device_type, init_scale=a.init_scale, growth_factor=a.growth_factor,
                                    backoff_factor=a.backoff_factor, growth_interval=a.growth_interval)


def micro_batch_size(batch_size: int, accum_steps: int) -> int:
    """The micro-batch of an accumulating variant; the effective batch stays ``batch_size``."""
    if accum_steps < 1 or batch_size % accum_steps:
        raise ValueError(f"accum_steps={accum_steps} must divide batch_size={batch_size}")
    return batch_size // accum_steps
