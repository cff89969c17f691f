"""mxfp8: torchao's MX training (``MXFP8TrainingOpConfig``, applied with ``quantize_``) of the Linear layers whose
dimensions allow it; the rest in bf16 autocast. Each GEMM operand is cast to float8 e4m3 in blocks of 32 values
that share one power-of-two (e8m0) scale, in all three GEMMs of a Linear: the forward, the input's gradient and the
weight's gradient. So in_features, out_features and the rows of each micro-batch (images x tokens) must be
multiples of 32 (torchao asserts it, emulated too; mxfp8_rceil_wgrad_with_hp runs the weight's gradient in bf16, so
there the rows are free).

Recipes (torchao's ``MXFP8TrainingRecipe``): mxfp8_rceil (MX kernels, rounding the scale up), mxfp8_rceil_wgrad_with_hp
(the weight's gradient in bf16), mxfp8_emulated_rceil (plain PyTorch ops: any device, slowly; the only one a CPU
runs). torchao's MX kernels run on compute capability 10.x (B200); on 12.x (RTX 5090, RTX PRO 6000) they are not
measured here, so the rung and its datasheet column are n/a there until they are.

Unlike fp8's ``Float8Linear``, MX wraps the layer's weight: every ``F.linear`` on it runs in MX, also where a parent
uses the weight directly (torchvision's attention with ``out_proj``). torchao's wrapper (``MXFP8TrainingWeightWrapper
Tensor``) takes over ``F.linear`` before autocast and drops its ``bias``; ampbench's (``MXWeight``) adds the bias and
casts both operands to autocast's dtype first, as autocast does for a Linear (MX's CUDA casts take bf16 only).
"""

from __future__ import annotations

from dataclasses import dataclass

from ampbench.errors import ConfigError
from ampbench.precision.linear import LinearRung, frozen_out, keeps, layer_count

BLOCK = 32  # values per shared scale; every dimension of every MX GEMM is a multiple of it
EMULATED = "mxfp8_emulated_rceil"


def eligible(module, fqn: str = "") -> bool:
    """A Linear layer MX training can convert: both of its dimensions multiples of 32."""
    from torch import nn
    return isinstance(module, nn.Linear) and module.in_features % BLOCK == 0 and module.out_features % BLOCK == 0


def _weight_class():
    """``MXWeight``: torchao's MX weight wrapper, whose ``F.linear`` keeps the bias and autocast's cast (made once, on
    first use: torchao is imported only by a run that converts)."""
    global MXWeight
    if MXWeight is not None:
        return MXWeight
    import torch
    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor
    from torchao.prototype.moe_training.utils import unwrap_weight

    class _MXWeight(MXFP8TrainingWeightWrapperTensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "__name__", "") != "linear" or len(args) < 2 or not isinstance(args[1], cls):
                return super().__torch_function__(func, types, args, kwargs)
            x, weight = args[0], unwrap_weight(args[1])
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            kind = x.device.type
            if torch.is_autocast_enabled(kind):  # what autocast does to F.linear, which this call comes before
                dtype = torch.get_autocast_dtype(kind)
                x, weight = x.to(dtype), weight.to(dtype)
                bias = bias.to(dtype) if bias is not None else None
            config = args[1].config
            with torch.autocast(kind, enabled=False):
                out = _to_mxfp8_then_scaled_mm(x, weight, kernel_preference=config.kernel_preference,
                                               scale_calculation_mode=config.scale_calculation_mode,
                                               wgrad_with_hp=config.wgrad_with_hp)
                return out if bias is None else out + bias.to(out.dtype)

    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    _MXWeight.__name__ = _MXWeight.__qualname__ = "MXWeight"  # importable by name (pickle, deepcopy): this module's
    MXWeight = _MXWeight
    return MXWeight


MXWeight = None


def __getattr__(name):
    if name == "MXWeight":
        return _weight_class()
    raise AttributeError(name)


def convert(model, recipe: str, ends: bool = False):
    """MX training on ``model``'s eligible Linear layers (less its ends, unless ``ends``), in place, with ``recipe``:
    each one's weight wrapped in ``MXWeight`` with torchao's config for it; its bias stays a plain parameter."""
    from torch import nn
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(recipe))
    wrap = _weight_class()
    take = keeps(model, eligible, ends)
    for name, module in list(model.named_modules()):
        if take(module, name):
            w = module.weight
            module.weight = nn.Parameter(wrap(w.data, config), requires_grad=w.requires_grad)
    return model


def _wgrad_in_bf16(recipe: str) -> bool:
    return recipe.endswith("_wgrad_with_hp")  # the weight's gradient GEMM in high precision (bf16)


def layers(model, recipe: str, image_size: int, ends: bool = False) -> dict:
    """What MX converts in ``model``, found on an unconverted meta copy (the same layers, with no MX op run): the
    eligible Linear layers whose weight a forward pass multiplies by (through the layer or through its parent),
    their share of the forward FLOPs, the widest, and the rows per image of each (tokens: the micro-batch rule)."""
    import copy
    import inspect

    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode, redispatch_function
    from torch.utils.flop_counter import FlopCounterMode

    model = copy.deepcopy(model).to("meta") if any(not p.is_meta for p in model.parameters()) else model
    take = keeps(model, eligible, ends)
    weights = {id(m.weight): (name, m) for name, m in model.named_modules() if take(m, name)}
    called: dict[str, float] = {}
    rows: dict[str, int] = {}

    class Linears(TorchFunctionMode):
        """Sees every F.linear, also inside a Python function that takes tensors (F.multi_head_attention_forward
        with ``out_proj.weight``): a mode is off while it handles a call, so it runs such a function one dispatch
        level down with itself on (the ops inside are seen), a builtin as it is."""

        def __init__(self):
            super().__init__()
            self.calling: list = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.linear:
                weight = args[1] if len(args) > 1 else kwargs.get("weight")
                if id(weight) in weights:
                    name, m = weights[id(weight)]
                    n = args[0].numel() // m.in_features
                    called[name] = called.get(name, 0.0) + 2.0 * n * m.in_features * m.out_features
                    rows[name] = n // 2  # per image of the batch of 2 below
                return func(*args, **kwargs)
            # a builtin has nothing inside to see; a Tensor method written in Python that calls its C self
            # (``super().unflatten``) comes back here as itself, and runs
            if not inspect.isfunction(func) or self.calling[-1:] == [func]:
                return func(*args, **kwargs)
            self.calling.append(func)
            try:
                with self:
                    return redispatch_function(func, types, args, kwargs)
            finally:
                self.calling.pop()

    x = torch.zeros(2, 3, image_size, image_size, device="meta")
    counter = FlopCounterMode(display=False)
    with counter, Linears(), torch.no_grad():
        model.train()(x)
    total = counter.get_total_flops()
    shapes = {name: [m.in_features, m.out_features, rows[name]] for name, m in weights.values() if name in called}
    widest = max(shapes.values(), key=lambda s: s[0] * s[1])[:2] if shapes else None
    return {"recipe": recipe, "converted": len(weights), "called": sorted(called),
            "frozen": frozen_out(model, eligible, ends),
            "flop_share": sum(called.values()) / total if total else 0.0, "widest": widest,
            "layers": dict(sorted(shapes.items())), "rows_per_image": sorted(set(rows.values()))}


@dataclass(frozen=True)
class MXFP8(LinearRung):
    def prepare(self, model, recipe: str | None = None, ends: bool = False, sharded: bool = False):
        return convert(model, recipe or self.default_recipe, ends)  # (no fsdp_recipes: runplan refuses FSDP)

    def census(self, model, recipe: str | None, image_size: int, ends: bool = False) -> dict:
        return layers(model, recipe or self.default_recipe, image_size, ends)

    def wgrad_low(self, recipe: str | None) -> bool:
        return not _wgrad_in_bf16(recipe or self.default_recipe)

    def operand_spy(self):
        """Every tensor MX quantizes (``MXTensor.to_mx``: the emulated recipe's casts, and the path of the CUDA
        ones), its dtype recorded."""
        import contextlib

        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        @contextlib.contextmanager
        def spying():
            seen, real, attr = [], MXTensor.to_mx, MXTensor.__dict__["to_mx"]

            def to_mx(data_hp, *args, **kwargs):
                seen.append(data_hp.dtype)
                return real(data_hp, *args, **kwargs)
            MXTensor.to_mx = staticmethod(to_mx)
            try:
                yield seen
            finally:
                MXTensor.to_mx = attr
        return spying()

    def peak_column(self, op_dtype: str, row: dict) -> str | None:
        return self.datasheet if op_dtype.startswith("float8") else super().peak_column(op_dtype, row)

    def roofline_model(self, model, recipe: str | None, ends: bool = False):
        return model  # counted unconverted (MX ops do not run on meta tensors); its GEMMs found by shape below

    def converted_gemms(self, model, recipe: str | None, ends: bool = False):
        """Whether a GEMM (its two operands' shapes) is one of a converted layer's: the forward (rows x in)
        @ (in x out), the input's gradient (rows x out) @ (out x in), and, unless the recipe keeps it in bf16, the
        weight's (out x rows) @ (rows x in). By shapes: an unconverted GEMM of the same dimensions (an attention's
        packed projection whose width equals a converted layer's) would be counted as converted too."""
        take = keeps(model, eligible, ends)
        pairs = {tuple(sorted((m.in_features, m.out_features))) for n, m in model.named_modules() if take(m, n)}
        wgrad = not _wgrad_in_bf16(recipe or self.default_recipe)

        def is_mx(a: tuple, b: tuple) -> bool:
            (m, k), n = a, b[-1]
            return tuple(sorted((k, n))) in pairs or (wgrad and k % BLOCK == 0 and tuple(sorted((m, n))) in pairs)
        return is_mx if pairs else None

    def unsupported(self, gpu: dict | None) -> str | None:
        if gpu is None:
            return None
        major = int(str(gpu["capability"]).split(".")[0])
        if major == 10:
            return None
        if major == 12:
            return (f"precision {self.name} on {gpu['name']} (compute capability {gpu['capability']}): torchao's MX "
                    "training kernels are built and measured for compute capability 10.x (B200); on 12.x they are "
                    f"not measured here, so {self.name} is n/a on this GPU until they are; use fp8 or bf16")
        return (f"a variant asks for precision {self.name} but {gpu['name']} (compute capability {gpu['capability']}) "
                "has no MX (block-scaled fp8) tensor cores, which need compute capability 10.x (B200); remove that "
                "variant, or use fp8 (8.9 and later) or bf16")

    def check(self, variant: str, recipe: str | None, device: str) -> None:
        said = f"{recipe!r}" if recipe else f"{self.default_recipe!r} (the default)"
        recipe = recipe or self.default_recipe
        if device == "cpu" and recipe not in self.cpu_recipes:
            raise ConfigError(f"params.yaml: variants.{variant}.recipe = {said} cannot run on a CPU (torchao's "
                              f"MX kernels need a GPU); use {' or '.join(self.cpu_recipes)} here, or run on a B200")

    def warnings(self, census: dict, compiled: bool, device: str, model_name: str) -> list[str]:
        out = [] if census["called"] else [self.no_layer(model_name)]
        if device == "cpu":
            out.append(f"{self.name} on a CPU is emulated ({EMULATED}: plain PyTorch ops that quantize and dequantize "
                       "each block): it shows that MX training runs and what it does to accuracy, not what MX buys")
        return out

    def runs_note(self, runs: list[tuple[str, dict]]) -> str:
        return (f"{self.name} has no loss scale either: each block of {BLOCK} values carries its own power-of-two "
                "scale, set from the block's absolute maximum (" + ", ".join(
                    f"`{n}`: {r.get('fp8_recipe')}, {layer_count(r.get('fp8_layers'))} Linear layers converted"
                    for n, r in runs) + "); the rest of the model runs under bf16 autocast.")


RUNGS = [
    MXFP8("mxfp8", "MXFP8", autocast="bfloat16", datasheet="mxfp8",
          recipes=("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp", EMULATED), cpu_recipes=(EMULATED,),
          emulated_on_cpu=True, always_counted=False, in_ladder=False, multiple=BLOCK, format_name="MX fp8",
          fast_compiled=True, operand_dtypes=("bfloat16",),  # the Triton dim-0 cast asserts bf16
          rows_rule_on_cpu=True, rows_why=f"MX scales blocks of {BLOCK} values along them",
          reach="it multiplies by",
          format_how=f" (e4m3 in blocks of {BLOCK} with a shared power-of-two scale, in all three GEMMs)"),
]
