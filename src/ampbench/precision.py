"""Precision: the one place that knows what each precision means.

- fp32: no autocast, no scaler, strict IEEE fp32 (TF32 off for matmuls and convolutions).
- tf32: fp32 weights and activations, matmuls and convolutions on TF32 tensor cores (10-bit mantissa): what
  ``torch.set_float32_matmul_precision("high")`` with cuDNN's default gives. PyTorch's own default is TF32
  convolutions with IEEE matmuls. On a CPU, or a GPU before Ampere, tf32 is fp32.
- fp16: ``torch.amp.autocast`` to float16 plus ``torch.amp.GradScaler``, because fp16's narrow range
  (6e-8 .. 65504) lets small gradients underflow to zero.
- bf16: autocast to bfloat16 with no scaler: bf16 has fp32's exponent range; needs a GPU with native bf16.

- fp8: torchao's float8 training (``convert_to_float8_training``) of the Linear layers whose dimensions allow
  it (both multiples of 16), with a recipe (tensorwise | rowwise | rowwise_with_gw_hp); the rest in bf16
  autocast. Needs compute capability 8.9 (Ada, Hopper, Blackwell). On a CPU it runs through
  ``torch._scaled_mm``'s CPU path, emulated, and ``Float8Linear`` follows CUDA autocast only, so its inputs stay
  fp32 there: a check that fp8 training runs, not the GPU's dtype path.

In fp16, bf16 and fp8, the ops autocast leaves in fp32 (softmax, norms, losses, the optimizer) run with TF32 off:
only the tf32 precision turns it on, so each rung of the ladder changes one thing.

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
    tf32: bool = False                  # fp32 matmuls and convolutions run on TF32 tensor cores
    float8: bool = False                # its eligible Linear layers train in float8 (torchao)

    def prepare(self, model: nn.Module, recipe: str | None = None) -> nn.Module:
        """The model as this precision trains it: fp8 converts its eligible Linear layers in place."""
        return convert_float8(model, recipe or "tensorwise") if self.float8 else model


SPECS: dict[str, Spec] = {
    "fp32": Spec("fp32", None, False, "fp32"),
    "tf32": Spec("tf32", None, False, "tf32", tf32=True),
    "fp16": Spec("fp16", torch.float16, True, "fp16"),
    "bf16": Spec("bf16", torch.bfloat16, False, "bf16", capability="bf16_supported",
                 capability_fix="remove that variant or use fp16"),
    "fp8": Spec("fp8", torch.bfloat16, False, "fp8", capability="fp8_supported",
                capability_fix="fp8 tensor cores need compute capability 8.9 or later (Ada, Hopper, Blackwell); "
                               "remove that variant, or use bf16", float8=True),
}
FP8_MULTIPLE = 16  # torch._scaled_mm needs both dimensions of each fp8 GEMM to be multiples of 16
CPU_FP8_RECIPES = ("tensorwise", "rowwise")  # rowwise_with_gw_hp's bf16 gradient GEMM fails under CPU autocast
SMALL_GEMM = 2048  # below this on every side, fp8's scaling and casts outweigh its faster GEMM (torchao's benchmark)
SMALL_GEMM_NOTE = ("fp8 pays off only on large GEMMs (torchao's own H100 benchmark: fp8 0.80x bf16 at "
                   "1024x2048x1024, 1.39x at 4096x8192x16384)")


def float8_eligible(module: nn.Module, fqn: str = "") -> bool:
    """A Linear layer float8 training can convert: both of its dimensions multiples of 16."""
    return isinstance(module, nn.Linear) and module.in_features % FP8_MULTIPLE == 0 \
        and module.out_features % FP8_MULTIPLE == 0


def convert_float8(model: nn.Module, recipe: str) -> nn.Module:
    """torchao's float8 training on ``model``'s eligible Linear layers, in place, with ``recipe``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                      module_filter_fn=float8_eligible)


def float8_layers(model: nn.Module, recipe: str, image_size: int) -> dict:
    """What fp8 converts in ``model`` (a copy is converted), counted by forward hooks on the layers a forward
    pass actually calls (a converted layer whose weight its parent uses directly, as torchvision's attention does
    with ``out_proj``, is not called and stays in bf16): the layers, their share of the model's forward FLOPs,
    and the widest of them."""
    import copy

    from torch.utils.flop_counter import FlopCounterMode
    if any(not p.is_meta for p in model.parameters()):  # shapes only: no weights copied, however large the model
        model = copy.deepcopy(model).to("meta")
    x = torch.zeros(2, 3, image_size, image_size, device="meta")
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        copy.deepcopy(model).train()(x)
    total = counter.get_total_flops()
    converted = convert_float8(copy.deepcopy(model), recipe)
    from torchao.float8.float8_linear import Float8Linear
    called: dict[str, float] = {}
    shapes: dict[str, list[int]] = {}
    handles = []
    for name, m in converted.named_modules():
        if isinstance(m, Float8Linear):
            def hook(mod, inp, out, name=name):
                rows = inp[0].numel() // mod.in_features
                called[name] = called.get(name, 0.0) + 2.0 * rows * mod.in_features * mod.out_features
                shapes[name] = [mod.in_features, mod.out_features]
            handles.append(m.register_forward_hook(hook))
    with torch.no_grad():
        converted.train()(x)
    for h in handles:
        h.remove()
    widest = max(shapes.values(), key=lambda s: s[0] * s[1]) if shapes else None
    return {"recipe": recipe, "converted": len(handles), "called": sorted(called),
            "flop_share": sum(called.values()) / total if total else 0.0, "widest": widest}

DTYPES = {name: s.autocast_dtype or torch.float32 for name, s in SPECS.items()}


def spec(name: str) -> Spec:
    return SPECS[name]


def amp_settings(name: str, amp: AmpConfig) -> AmpConfig | None:
    """params.yaml's GradScaler settings for a precision that uses a scaler; None for the others (their plans
    do not change when the loss scale is edited, so DVC does not rerun them)."""
    return amp if SPECS[name].grad_scaler else None


def datasheet_column(name: str) -> str:
    """Which datasheet peak column a precision's matmuls and convolutions run at."""
    return SPECS[name].datasheet


def notes(precisions: set[str], gpu: dict | None) -> list[str]:
    """What a precision cannot show on this machine, said before training (not an error: it still runs)."""
    if "tf32" not in precisions:
        return []
    if gpu is None:
        return ["tf32 is fp32 on a CPU (no TF32 hardware): the tf32 variant measures the same arithmetic as fp32"]
    if not gpu.get("tf32_capable"):
        return [f"{gpu['name']} (compute capability {gpu['capability']}) has no TF32 tensor cores (Ampere and "
                "later do): the tf32 variant runs strict fp32 there"]
    return []


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
    fp8_recipe: str | None = None  # fp8 only: torchao's recipe

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model as this precision trains it (fp8: its eligible Linear layers converted)."""
        return self.spec.prepare(model, self.fp8_recipe)

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
