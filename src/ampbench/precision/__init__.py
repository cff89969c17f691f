"""Precision: the registry of the ladder's rungs, and the one place that knows what each rung means.

Each family of rungs is one module of this package; ``FAMILIES`` names them, one line each:

- ``ieee``: fp32 (strict IEEE fp32: TF32 off for matmuls and convolutions) and tf32 (fp32 weights and activations,
  matmuls and convolutions on TF32 tensor cores; on a CPU or a GPU before Ampere, fp32).
- ``autocast``: fp16 (``torch.amp.autocast`` to float16 plus ``GradScaler``: fp16's narrow range lets small
  gradients underflow) and bf16 (autocast to bfloat16, no scaler: needs native bf16).
- ``float8``: fp8, torchao's float8 training of the Linear layers it can convert, the rest in bf16 autocast.
- ``mxfp8``: mxfp8, torchao's MX training: fp8 in blocks of 32 values with a shared scale, in every GEMM of the
  Linear layers it can convert (Blackwell, compute capability 10.x).

A rung (``Rung``) owns its autocast dtype, its GradScaler, how it converts a model and what it converts (the
census), its capability gate and the fix, its datasheet column, what the roofline counts it in, its recipes and
their validation, and its label in the report. Everything else asks this registry, and this module imports no
torch (the params schema and the report read it); ``train.policy`` applies a rung in training (the autocast
context, the GradScaler). A new rung is one module that lists its ``RUNGS``, and its line in ``FAMILIES``.

In fp16, bf16 and fp8, the ops autocast leaves in fp32 (softmax, norms, losses, the optimizer) run with TF32 off:
only the tf32 rung turns it on, so each rung of the ladder changes one thing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

FAMILIES = [
    "ampbench.precision.ieee",
    "ampbench.precision.autocast",
    "ampbench.precision.float8",
    "ampbench.precision.mxfp8",
]

BASELINE = "fp32"  # strict IEEE fp32: what every speedup is measured against


@dataclass(frozen=True)
class Rung:
    """One rung of the precision ladder. A family subclasses it where its rungs do more than autocast."""

    name: str
    label: str                      # the report's name for it: FP16-AMP
    autocast: str | None = None     # the torch dtype autocast computes eligible ops in; None: no autocast
    grad_scaler: bool = False       # loss scaling keeps small gradients from flushing to zero
    tf32: bool = False              # fp32 matmuls and convolutions on TF32 tensor cores
    datasheet: str = "fp32"         # the datasheet column its tensor-core work runs at
    gate: str | None = None         # the env.json GPU flag it needs (True there), if any
    gate_fix: str = ""              # what to do on a GPU without it
    recipes: tuple[str, ...] = ()   # the recipes it takes (the first is the default); () = none
    fsdp_recipes: tuple[str, ...] = ()  # a converting rung's recipes FSDP runs: its weights gathered in its format
    cpu_recipes: tuple[str, ...] = ()  # those that run on a CPU, when not all of them do
    emulated_on_cpu: bool = False   # a CPU has no such arithmetic: a step there shows it runs, not its speed
    always_counted: bool = True     # the roofline counts it even when no variant trains in it
    in_ladder: bool = True          # `ampbench demo --ladder` trains it (a CPU runs it at the demo's batch)
    scaling_files: tuple[str, ...] = ()  # source files whose ops torch.compile fuses into its casts (the roofline)
    fast_compiled: bool = False     # fast only under torch.compile: train.compile auto compiles it on CUDA

    # --- what a family may override -------------------------------------------------------------------------
    def prepare(self, model, recipe: str | None = None, ends: bool = False, sharded: bool = False):
        """The model as this rung trains it (in place): a converting family swaps its layers (``ends``: the
        model's first layer and classifier head too, which it leaves in high precision by default; ``sharded``: for
        FSDP, its converted weights all-gathered in its format, ``fsdp_recipes``)."""
        return model

    def fsdp_refuses(self, recipe: str | None) -> str | None:
        """Why this rung (with ``recipe``) does not train under FSDP here, or None: a converting rung needs an
        all-gather of its own format for that recipe (``fsdp_recipes``)."""
        if not self.converts or (recipe or self.default_recipe) in self.fsdp_recipes:
            return None
        if not self.fsdp_recipes:
            return f"precision {self.name} has no all-gather of its own format under FSDP"
        return (f"{self.name} recipe {recipe!r} under FSDP: torchao all-gathers its weights in their own format with "
                f"the {' or '.join(self.fsdp_recipes)} recipe only")

    def fsdp_low_weights(self, model) -> set[int]:
        """The ids of the weights FSDP all-gathers in this rung's own low format (a converted model's, prepared
        ``sharded``); none for a rung that converts nothing."""
        return set()

    def fsdp_after_step(self, model) -> None:
        """What a model sharded with low-format weights needs after each optimizer step (and after its weights are
        loaded): nothing, unless the family says."""

    def census(self, model, recipe: str | None, image_size: int, ends: bool = False) -> dict | None:
        """What the conversion changes in ``model`` (on a meta copy): ``{"recipe", "converted", "called", ...}``,
        ``called`` the converted layers a forward pass runs converted (what a run's metrics count); None for a rung
        that converts nothing."""
        return None

    def runs_on(self, row: dict) -> bool:
        """Whether a GPU (its datasheet row) can run this rung at all."""
        return True

    def peak_column(self, op_dtype: str, row: dict) -> str | None:
        """The datasheet column an op whose math runs in ``op_dtype`` reaches under this rung; fp32 math runs on
        TF32 tensor cores only in a tf32 rung."""
        if op_dtype.startswith("float8"):
            return "fp8"
        low = {"float16": "fp16", "bfloat16": "bf16"}.get(op_dtype)
        if low:
            return low
        return "tf32" if self.tf32 and row.get("tf32") else "fp32"

    def roofline_model(self, model, recipe: str | None, ends: bool = False):
        """The model the roofline counts (on meta tensors): prepared as training prepares it."""
        return self.prepare(model, recipe, ends)

    def counts_model_as_is(self) -> bool:
        """Whether the roofline counts the model as it is, no layer swapped (neither ``prepare`` nor
        ``roofline_model`` overridden): such precisions may count one copy of the model and its optimizer."""
        return type(self).prepare is Rung.prepare and type(self).roofline_model is Rung.roofline_model

    def converted_gemms(self, model, recipe: str | None, ends: bool = False):
        """For a rung the roofline counts unconverted: a function of a GEMM's two operand shapes that says whether
        the conversion runs it in fp8 (in blocks: the operands cast to fp8 with a scale per 32 values); None."""
        return None

    def check(self, variant: str, recipe: str | None, device: str) -> None:
        """A ConfigError if this rung cannot run ``recipe`` on ``device`` (before anything is written)."""

    def gpu_refuses(self, recipe: str | None, gpu: dict, validated: set[str]) -> str | None:
        """Why ``gpu`` (env.json's) cannot be trusted to run ``recipe`` of this rung, which ``validated`` (the
        recipes ``make gpu-validate`` ran on this card) may lift; None where it can."""
        return None

    def images_multiple(self, census: dict, device: str) -> int:
        """The least number of images a micro-batch of a converted model must be a multiple of on ``device``."""
        return 1

    def check_batches(self, census: dict, batches: dict[str, int], device: str) -> list[str]:
        """A ConfigError if a micro-batch (``batches``: where params.yaml sets it -> images) cannot run converted on
        ``device``; what to warn of where it runs here but would not on a GPU."""
        return []

    def warnings(self, census: dict, compiled: bool, device: str, model_name: str) -> list[str]:
        """What to tell a user about this rung on this model and device, before training."""
        return []

    def kernels(self, device: str):
        """A context the rung's forward and backward passes run in on ``device`` (which kernels serve its ops);
        none by default."""
        import contextlib
        return contextlib.nullcontext()

    def census_lines(self, census: dict) -> list[str]:
        """The report's lines on what it converted (roofline.json's census)."""
        return []

    def census_summary(self, census: dict) -> str:
        """env_check's one line on what it converts."""
        return ""

    def measured_column(self, converted: int | None) -> str:
        """The datasheet column a run's achieved FLOP/s is set against, given how many layers it converted."""
        return self.datasheet

    def runs_note(self, runs: list[tuple[str, dict]]) -> str | None:
        """The report's numerics note on its runs (``runs``: variant name and summary row), if it has one."""
        return None

    # --- derived ---------------------------------------------------------------------------------------------
    @property
    def converts(self) -> bool:
        return type(self).census is not Rung.census

    @property
    def default_recipe(self) -> str | None:
        return self.recipes[0] if self.recipes else None

    def unsupported(self, gpu: dict | None) -> str | None:
        """Why ``gpu`` (env.json's) cannot run this rung, with the fix; None if it can (or on a CPU)."""
        if gpu is None or self.gate is None or gpu.get(self.gate):
            return None
        return (f"a variant asks for precision {self.name} but {gpu['name']} (compute capability "
                f"{gpu['capability']}) has no native {self.name}; {self.gate_fix}")


RUNGS: dict[str, Rung] = {}


def register(module: str) -> None:
    """Add the rungs of a family module (its ``RUNGS`` list) to the registry."""
    for r in importlib.import_module(module).RUNGS:
        RUNGS[r.name] = r


def unregister(module: str) -> None:
    for r in importlib.import_module(module).RUNGS:
        RUNGS.pop(r.name, None)


for _family in FAMILIES:
    register(_family)


def names() -> tuple[str, ...]:
    """Every rung, in the ladder's order (the families' order, then each family's)."""
    return tuple(RUNGS)


def rung(name: str) -> Rung:
    return RUNGS[name]


def label(name: str) -> str:
    r = RUNGS.get(name)
    return r.label if r else name


def amp_settings(name: str, amp):
    """params.yaml's GradScaler settings for a precision that uses a scaler; None for the others (their plans
    do not change when the loss scale is edited, so DVC does not rerun them)."""
    return amp if RUNGS[name].grad_scaler else None


def recipe_for(name: str, recipe: str | None) -> str | None:
    """The recipe a variant of precision ``name`` trains with: its own, else the rung's default; None for a rung
    that takes no recipe."""
    r = RUNGS[name]
    return (recipe or r.default_recipe) if r.recipes else None


def converting(precisions) -> list[str]:
    """Those of ``precisions`` that convert a model's layers (each has a census)."""
    return [p for p in dict.fromkeys(precisions) if RUNGS[p].converts]


def notes(precisions: set[str], gpu: dict | None) -> list[str]:
    """What a precision cannot show on this machine, said before training (not an error: it still runs)."""
    tf32 = [p for p in precisions if RUNGS[p].tf32]
    if not tf32:
        return []
    if gpu is None:
        return [f"{tf32[0]} is fp32 on a CPU (no TF32 hardware): the {tf32[0]} variant measures the same arithmetic "
                "as fp32"]
    if not gpu.get("tf32_capable"):
        return [f"{gpu['name']} (compute capability {gpu['capability']}) has no TF32 tensor cores (Ampere and "
                f"later do): the {tf32[0]} variant runs strict fp32 there"]
    return []


def unsupported(name: str, gpu: dict | None) -> str | None:
    """Why ``gpu`` (env.json's) cannot run this precision, with the fix; None if it can (or on a CPU)."""
    return RUNGS[name].unsupported(gpu)


def set_tf32(allow: bool) -> dict:
    """Allow or forbid TF32 for fp32 matmuls and convolutions; return the flags now in force.

    On Ampere and later, PyTorch runs fp32 convolutions in TF32 by default, so an
    "FP32" baseline would really be TF32. The strict baseline sets IEEE fp32.

    Set through the ``allow_tf32`` flags, not the ``fp32_precision`` API: setting the latter for matmuls and
    convolutions alone leaves torch (2.14) with a mix it refuses to report, so that
    ``torch.backends.cudnn.allow_tf32`` (strict) or ``torch.backends.cuda.matmul.allow_tf32`` and
    ``torch.get_float32_matmul_precision()`` (TF32) raise, and inductor and users' code read those.
    """
    import torch
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow
    return tf32_flags()


def tf32_flags() -> dict:
    """What fp32 matmuls and cuDNN convolutions run in: ``tf32`` or ``ieee``."""
    import torch
    return {"matmul_fp32_precision": "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee",
            "cudnn_conv_fp32_precision": "tf32" if torch.backends.cudnn.allow_tf32 else "ieee"}
