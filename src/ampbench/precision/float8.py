"""fp8: torchao's float8 training (``convert_to_float8_training``) of the Linear layers whose dimensions allow it
(both multiples of 16), with a recipe (tensorwise | rowwise | rowwise_with_gw_hp); the rest in bf16 autocast.
Needs compute capability 8.9 (Ada, Hopper, Blackwell). On a CPU it runs through ``torch._scaled_mm``'s CPU path,
emulated, and ``Float8Linear`` follows CUDA autocast only, so its inputs stay fp32 there: a check that fp8
training runs, not the GPU's dtype path.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ampbench.errors import ConfigError
from ampbench.precision.linear import LinearRung, frozen_out, keeps, layer_count

MULTIPLE = 16  # torch._scaled_mm needs both dimensions of each fp8 GEMM to be multiples of 16
SMALL_GEMM = 2048  # below this on every side, fp8's scaling and casts outweigh its faster GEMM (torchao's benchmark)
SMALL_GEMM_NOTE = ("fp8 pays off only on large GEMMs (torchao's own H100 benchmark: fp8 0.80x bf16 at "
                   "1024x2048x1024, 1.39x at 4096x8192x16384)")
# torchao's float8 scaling and casting code (amax, scale, saturated cast): torch.compile fuses its ops
SCALING_FILES = ("float8_scaling_utils.py", "float8_utils.py", "float8_training_tensor.py")


@contextlib.contextmanager
def _mkldnn_off():
    import torch
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)


def eligible(module, fqn: str = "") -> bool:
    """A Linear layer float8 training can convert: both of its dimensions multiples of 16."""
    from torch import nn
    return isinstance(module, nn.Linear) and module.in_features % MULTIPLE == 0 \
        and module.out_features % MULTIPLE == 0


def convert(model, recipe: str, ends: bool = False, sharded: bool = False):
    """torchao's float8 training on ``model``'s eligible Linear layers (less its ends, unless ``ends``), in place,
    with ``recipe``; ``sharded``: for FSDP, their weights all-gathered in fp8 (torchao's float8 all-gather, which
    casts each shard with the scale of the whole weight: the tensorwise recipe only)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    config = Float8LinearConfig.from_recipe_name(recipe)
    if sharded:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(model, config=config, module_filter_fn=keeps(model, eligible, ends))


def _converted_layers(model) -> list:
    from torchao.float8.float8_linear import Float8Linear
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def layers(model, recipe: str, image_size: int, ends: bool = False) -> dict:
    """What fp8 converts in ``model``, found on an unconverted meta copy (no fp8 op run, no torchao needed): the
    layers its filter takes, and of those the ones a forward pass calls, by forward hooks (a converted layer whose
    weight its parent uses directly, as torchvision's attention does with ``out_proj``, is not called and stays in
    bf16); their share of the model's forward FLOPs, the widest, each one's [in, out, rows per image] (tokens:
    the micro-batch rule) and the distinct rows per image."""
    import copy

    import torch
    from torch.utils.flop_counter import FlopCounterMode
    if any(not p.is_meta for p in model.parameters()):  # shapes only: no weights copied, however large the model
        model = copy.deepcopy(model).to("meta")
    take = keeps(model, eligible, ends)
    chosen = [(name, m) for name, m in model.named_modules() if take(m, name)]
    called: dict[str, float] = {}
    shapes: dict[str, list[int]] = {}
    handles = []
    for name, m in chosen:
        def hook(mod, inp, out, name=name):
            rows = inp[0].numel() // mod.in_features
            called[name] = called.get(name, 0.0) + 2.0 * rows * mod.in_features * mod.out_features
            shapes[name] = [mod.in_features, mod.out_features, rows // 2]  # per image of the batch of 2 below
        handles.append(m.register_forward_hook(hook))
    x = torch.zeros(2, 3, image_size, image_size, device="meta")
    counter = FlopCounterMode(display=False)
    try:
        with counter, torch.no_grad():
            model.train()(x)
    finally:
        for h in handles:
            h.remove()
    total = counter.get_total_flops()
    widest = max(shapes.values(), key=lambda s: s[0] * s[1])[:2] if shapes else None
    return {"recipe": recipe, "converted": len(chosen), "called": sorted(called),
            "frozen": frozen_out(model, eligible, ends),
            "flop_share": sum(called.values()) / total if total else 0.0, "widest": widest,
            "layers": dict(sorted(shapes.items())), "rows_per_image": sorted({s[2] for s in shapes.values()})}


@dataclass(frozen=True)
class Float8(LinearRung):
    def prepare(self, model, recipe: str | None = None, ends: bool = False, sharded: bool = False):
        return convert(model, recipe or self.default_recipe, ends, sharded)

    def fsdp_low_weights(self, model) -> set[int]:
        return {id(m.weight) for _, m in _converted_layers(model) if m.config.enable_fsdp_float8_all_gather}

    def fsdp_after_step(self, model) -> None:
        """The scales of the next all-gathers, all weights' at once (one all-reduce of their amaxes: torchao's
        ``precompute_float8_dynamic_scale_for_fsdp``, as torchtitan hooks it); a collective, every rank calls it.
        Without it each gather computes its own, and after a load the weights would keep their old scales."""
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        precompute_float8_dynamic_scale_for_fsdp(model)

    def census(self, model, recipe: str | None, image_size: int, ends: bool = False) -> dict:
        return layers(model, recipe or self.default_recipe, image_size, ends)

    def wgrad_low(self, recipe: str | None) -> bool:
        return (recipe or self.default_recipe) != "rowwise_with_gw_hp"  # its weight's gradient GEMM runs in bf16

    def roofline_model(self, model, recipe: str | None, ends: bool = False):
        """Converted as training converts it; under CUDA autocast a Float8Linear first casts its input to
        autocast's dtype, which the counter (playing autocast on meta tensors) does for it."""
        import torch
        model = self.prepare(model, recipe, ends)
        low = getattr(torch, self.autocast)
        for _, m in _converted_layers(model):
            m.register_forward_pre_hook(lambda mod, args: (args[0].to(low), *args[1:]))
        return model

    def check(self, variant: str, recipe: str | None, device: str) -> None:
        said = f"{recipe!r}" if recipe else f"{self.default_recipe!r} (the default)"
        recipe = recipe or self.default_recipe
        if device == "cpu" and recipe not in self.cpu_recipes:
            raise ConfigError(f"params.yaml: variants.{variant}.recipe = {said} cannot run on a CPU (its "
                              "high-precision gradient GEMM fails under CPU bf16 autocast); use "
                              f"{' or '.join(self.cpu_recipes)} here, or run on a GPU")

    def gpu_refuses(self, recipe: str | None, gpu: dict, validated: set[str]) -> str | None:
        """Rowwise scaling on compute capability 12.x (RTX 5090, RTX PRO 6000): cuBLAS' rowwise-scaled fp8 kernels
        are built for 8.9, 9.x and 10.x, and upstream reports "Rowwise scaling is not currently supported" on 12.x;
        allowed there once `make gpu-validate` has run a rowwise GEMM on the card."""
        recipe = recipe or self.default_recipe
        if not recipe.startswith("rowwise") or not str(gpu.get("capability", "")).startswith("12.") \
                or "rowwise" in validated:
            return None
        return (f"fp8 recipe {recipe!r} on {gpu['name']} (compute capability {gpu['capability']}): cuBLAS' rowwise-"
                "scaled fp8 GEMMs are built for compute capability 8.9, 9.x and 10.x, and on 12.x they are reported "
                "to fail (\"Rowwise scaling is not currently supported\"); use recipe: tensorwise, or run `make "
                "gpu-validate` on this card: where its fp8 check runs a rowwise GEMM, env_check allows it")

    def warnings(self, census: dict, compiled: bool, device: str, model_name: str) -> list[str]:
        out = [] if census["called"] else [self.no_layer(model_name)]
        if census["called"] and max(census["widest"]) < SMALL_GEMM:
            census["small_gemms"] = (f"its widest fp8 layer is {census['widest'][0]}x{census['widest'][1]}: "
                                     f"{SMALL_GEMM_NOTE}, so expect fp8 no faster than bf16 here")
            out.append(f"{self.name} on this model: {census['small_gemms']}")
        if not compiled and device != "cpu":
            out.append(f"precision {self.name} with train.compile: false runs eager: torchao's float8 training is fast "
                       "only under torch.compile (which fuses its scaling and casts), so the report labels its "
                       "figures eager; set train.compile: auto (or true)")
        if device == "cpu":
            out.append(f"{self.name} on a CPU is emulated (torch._scaled_mm's CPU path; Float8Linear follows CUDA "
                       "autocast only, so its inputs stay fp32) and eager (compiling would cost minutes): it shows "
                       "that fp8 training runs, not what fp8 buys, and it is not the GPU's fp8 tensor-core path")
        return out

    def kernels(self, device: str):
        """On a CPU, ``torch._scaled_mm`` through its emulated kernel (fp8 to fp32, scale, fp32 GEMM): on a CPU with
        AMX-INT8 (Intel Xeon, Sapphire Rapids and later) torch otherwise sends it to oneDNN's fp8 GEMM, which gives
        the same numbers about 250 times slower (a 136x192x768 GEMM: 340 ms against 1.4 ms, bit-identical). oneDNN
        is off only while the fp8 model runs; the other rungs keep it."""
        return _mkldnn_off() if device == "cpu" else super().kernels(device)

    def runs_note(self, runs: list[tuple[str, dict]]) -> str:
        """The report's numerics note on its runs (summary rows)."""
        return (f"{self.name} has no loss scale: before each fp8 GEMM torchao scales the tensor to fp8's range (e4m3 "
                "up to 448, e5m2 for gradients in the tensorwise recipe) from its current absolute maximum ("
                + ", ".join(f"`{n}`: {r.get('fp8_recipe')} scaling, {layer_count(r.get('fp8_layers'))} Linear "
                            "layers converted" for n, r in runs)
                + "); the rest of the model runs under bf16 autocast. The fp16 audit below does not apply to it.")


RUNGS = [
    Float8("fp8", "FP8", autocast="bfloat16", datasheet="fp8", gate="fp8_supported",
           gate_fix="fp8 tensor cores need compute capability 8.9 or later (Ada, Hopper, Blackwell); remove that "
                    "variant, or use bf16",
           recipes=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
           fsdp_recipes=("tensorwise",),  # torchao's float8 all-gather: tensorwise scaling only
           cpu_recipes=("tensorwise", "rowwise"),  # rowwise_with_gw_hp's bf16 gradient GEMM fails under CPU autocast
           emulated_on_cpu=True, always_counted=False, scaling_files=SCALING_FILES, multiple=MULTIPLE,
           fast_compiled=True,
           census_how=" (counted by forward hooks on the layers a forward pass calls)"),
]
