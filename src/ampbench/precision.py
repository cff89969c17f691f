"""Precision: the one place that knows what each precision means.

- fp32: no autocast, no scaler; strict IEEE unless ``train.allow_tf32`` (then its matmuls and convolutions
  run on TF32 tensor cores, and the datasheet's TF32 column applies).
- fp16: ``torch.amp.autocast`` to float16 plus ``torch.amp.GradScaler``, because fp16's narrow range
  (6e-8 .. 65504) lets small gradients underflow to zero.
- bf16: autocast to bfloat16 with no scaler: bf16 has fp32's exponent range; needs a GPU with native bf16.

Each is a ``Spec`` in ``SPECS``: its autocast dtype, whether it needs a GradScaler, the datasheet column its
tensor-core work runs at, the GPU capability it needs, and how it prepares a model. The engine asks a
``PrecisionPolicy`` for an autocast context and a scaler; a disabled scaler is a no-op, so the loop has one
code path for every precision. A new precision is a ``Spec`` here, its name in ``config.PRECISIONS``, and a
datasheet column in ``measure/flops.py``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from ampbench.config import AmpConfig


@dataclass(frozen=True)
class Spec:
    name: str
    autocast_dtype: torch.dtype | None  # what autocast computes eligible ops in; None: no autocast
    grad_scaler: bool                   # fp16: loss scaling keeps small gradients from flushing to zero
    datasheet: str                      # the datasheet peak column of its tensor-core work
    capability: str | None = None       # the env.json GPU flag it needs (True there), if any
    capability_fix: str = ""            # what to do on a GPU without it

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model as this precision trains it (the hook where fp8 would convert its Linear layers)."""
        return model


SPECS: dict[str, Spec] = {
    "fp32": Spec("fp32", None, False, "fp32"),
    "fp16": Spec("fp16", torch.float16, True, "fp16"),
    "bf16": Spec("bf16", torch.bfloat16, False, "bf16", capability="bf16_supported",
                 capability_fix="remove that variant or use fp16"),
}
DTYPES = {name: s.autocast_dtype or torch.float32 for name, s in SPECS.items()}


def spec(name: str) -> Spec:
    return SPECS[name]


def amp_settings(name: str, amp: AmpConfig) -> AmpConfig | None:
    """params.yaml's GradScaler settings for a precision that uses a scaler; None for the others (their plans
    do not change when the loss scale is edited, so DVC does not rerun them)."""
    return amp if SPECS[name].grad_scaler else None


def datasheet_column(name: str, allow_tf32: bool) -> str:
    """Which datasheet peak applies: fp32 runs on TF32 tensor cores when TF32 is allowed."""
    column = SPECS[name].datasheet
    return "tf32" if column == "fp32" and allow_tf32 else column


def unsupported(name: str, gpu: dict | None) -> str | None:
    """Why ``gpu`` (env.json's) cannot run this precision, with the fix; None if it can (or on a CPU)."""
    s = SPECS[name]
    if gpu is None or s.capability is None or gpu.get(s.capability):
        return None
    return (f"a variant asks for precision {name} but {gpu['name']} (compute capability {gpu['capability']}) "
            f"has no native {name}; {s.capability_fix}")


def set_tf32(allow: bool) -> dict:
    """Allow or forbid TF32 for fp32 matmuls and convolutions; return the flags now in force.

    On Ampere and later, PyTorch runs fp32 convolutions in TF32 by default, so an
    "FP32" baseline would really be TF32. The strict baseline sets IEEE fp32.

    Set through the ``allow_tf32`` flags, not the ``fp32_precision`` API: setting the latter for matmuls and
    convolutions alone leaves torch (2.14) with a mix it refuses to report, so that
    ``torch.backends.cudnn.allow_tf32`` (strict) or ``torch.backends.cuda.matmul.allow_tf32`` and
    ``torch.get_float32_matmul_precision()`` (TF32) raise, and inductor and users' code read those.
    """
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow
    return tf32_flags()


def tf32_flags() -> dict:
    """What fp32 matmuls and cuDNN convolutions run in: ``tf32`` or ``ieee``."""
    return {"matmul_fp32_precision": "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee",
            "cudnn_conv_fp32_precision": "tf32" if torch.backends.cudnn.allow_tf32 else "ieee"}


@dataclass(frozen=True)
class PrecisionPolicy:
    precision: str          # a key of SPECS
    device_type: str        # cuda | cpu
    amp: AmpConfig | None   # GradScaler settings, used only by a precision that needs a scaler

    @property
    def spec(self) -> Spec:
        return SPECS[self.precision]

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def uses_autocast(self) -> bool:
        return self.spec.autocast_dtype is not None

    @property
    def uses_scaler(self) -> bool:
        return self.spec.grad_scaler

    def autocast(self) -> AbstractContextManager:
        """The forward-pass context: autocast to the precision's dtype, or a disabled one."""
        return torch.autocast(self.device_type, dtype=self.spec.autocast_dtype, enabled=self.uses_autocast)

    def scaler(self) -> torch.amp.GradScaler:
        """A GradScaler from params.yaml's ``amp`` section; disabled (a no-op) unless the precision needs one."""
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
