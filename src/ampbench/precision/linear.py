"""What the rungs that convert a model's Linear layers (fp8, mxfp8) share: which layers they leave in high precision
(the model's first layer and its classifier head, as torchao advises), the census's words, the rule that a run
converting nothing ran in bf16, that a GPU without the rung's tensor cores cannot run it at all, and the rule on a
micro-batch's rows: the weight's gradient GEMM, ``grad_output.t() @ input``, multiplies over the micro-batch's rows
(images x tokens), and a low-precision GEMM needs that inner dimension to be a multiple of the rung's ``multiple``
(CUDA's ``torch._scaled_mm``: 16; MX's blocks: 32)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ampbench.errors import ConfigError
from ampbench.precision import Rung


def end_names(model) -> set[str]:
    """The names of the model's ends, which a converting rung leaves in high precision unless ``model.convert_ends``
    says otherwise (torchao advises against converting the output layer): its first layer (the first module with
    parameters of its own, when it is a Linear) and its classifier head (the last Linear it registers)."""
    from torch import nn
    # the root's own parameters (a ViT's class token) are no layer
    owning = [(n, m) for n, m in model.named_modules() if n and next(m.parameters(recurse=False), None) is not None]
    out = {owning[0][0]} if owning and isinstance(owning[0][1], nn.Linear) else set()
    linears = [n for n, m in owning if isinstance(m, nn.Linear)]
    return out | set(linears[-1:])


def frozen(module) -> bool:
    """A layer whose own parameters are all frozen (fine-tuning's backbone)."""
    own = list(module.parameters(recurse=False))
    return bool(own) and not any(p.requires_grad for p in own)


def keeps(model, eligible, ends: bool):
    """The filter a conversion applies, ``(module, fqn) -> bool``: ``eligible`` layers, less the model's ends
    unless ``ends`` (convert them too), less frozen layers: torchao's float8 and MX Linear compute the weight's
    gradient GEMM whether or not the weight needs one (they check no ``needs_input_grad``), so a frozen layer
    converted would pay a GEMM that the same layer in bf16 skips."""
    kept = set() if ends else end_names(model)
    return lambda module, fqn="": eligible(module) and fqn not in kept and not frozen(module)


def frozen_out(model, eligible, ends: bool) -> list[str]:
    """The layers a conversion would take but for being frozen, which it keeps in bf16."""
    kept = set() if ends else end_names(model)
    return [n for n, m in model.named_modules() if eligible(m) and n not in kept and frozen(m)]


def layer_count(n) -> str:
    return "missing" if n is None else format(n, "d")


@dataclass(frozen=True)
class LinearRung(Rung):
    """A rung whose eligible Linear layers (both dimensions multiples of ``multiple``) run in a low format."""

    multiple: int = 16
    rows_rule_on_cpu: bool = False        # a CPU applies the micro-batch rows rule too (MX's emulation asserts it)
    rows_why: str = "CUDA's fp8 GEMM (torch._scaled_mm) takes inner dimensions that are multiples of 16 only"
    format_name: str = "float8"           # what the converted GEMMs run in, as the report says it
    reach: str = "it calls"               # which Linear layers count: those a forward calls, or whose weight it uses
    format_how: str = ""                  # the format's words in the report, after its name
    census_how: str = ""                  # how the census found the layers, for the report
    mantissa_bits: int = 3                # e4m3, what a converted GEMM's operands keep: its conformance tolerance
    operand_dtypes: tuple[str, ...] = ()  # the dtypes its CUDA casts to the low format take (): any float

    def tolerance(self, layers: int) -> tuple[float, str]:
        """How far a converted model's logits may be from the unconverted one's (relative, in norm), and its
        derivation: each converted GEMM rounds both operands to ``mantissa_bits`` (unit roundoff u = 2^-(m+1);
        a block or tensor scale is a power of two, which rounds nothing), so its output is off by about 2u
        relative; ``layers`` such GEMMs in turn, their rounding independent, add up as sqrt(layers)."""
        u = self.mantissa_bits + 1
        return 2 * 2.0 ** -u * math.sqrt(max(layers, 1)), f"2 x 2^-{u} x sqrt({layers} layers)"

    def operand_spy(self):
        """A context that yields a list, filled with the dtype of every tensor the rung casts to its low format
        while it is open (the conformance check's); none by default."""
        import contextlib
        return contextlib.nullcontext([])

    def wgrad_low(self, recipe: str | None) -> bool:
        """Whether ``recipe`` runs the weight's gradient GEMM in the low format (then the rows rule holds)."""
        return True

    def images_multiple(self, census: dict, device: str) -> int:
        """The least number of images whose micro-batch every converted layer's GEMMs take on ``device``: the
        rows (images x tokens) of the weight's gradient GEMM must be a multiple of ``multiple``."""
        if (device == "cpu" and not self.rows_rule_on_cpu) or not self.wgrad_low(census.get("recipe")):
            return 1
        return math.lcm(1, *(self.multiple // math.gcd(self.multiple, r) for r in census.get("rows_per_image") or []))

    def check_batches(self, census: dict, batches: dict[str, int], device: str) -> list[str]:
        """Refuse a micro-batch (``batches``: where params.yaml sets it -> images) whose rows in a converted layer
        break the rule on ``device``; on a CPU that does not apply it, say what a GPU would refuse."""
        need = self.images_multiple(census, "cuda")
        out = []
        for where, batch in batches.items():
            if batch % need == 0:
                continue
            r = next(r for r in census["rows_per_image"] if (batch * r) % self.multiple)
            said = (f"params.yaml: {where} gives {self.name} micro-batches of {batch} images, {batch} x {r} = "
                    f"{batch * r} rows in a converted layer; {self.rows_why}, so the rows must be a multiple of "
                    f"{self.multiple}")
            if self.images_multiple(census, device) > 1:
                raise ConfigError(f"{said}: make that micro-batch a multiple of {need} images")
            out.append(f"{said} on a GPU, which would refuse it (a CPU runs it): make it a multiple of {need} images "
                       "before you run this on a GPU")
        return out

    def measured_column(self, converted: int | None) -> str:
        # a run that converted nothing ran in bf16; one whose count could not be made (None) ran as its census said
        return "bf16" if converted == 0 else self.datasheet

    def runs_on(self, row: dict) -> bool:
        return bool(row.get(self.datasheet))  # without its tensor cores, not at all, whatever the model

    def no_layer(self, model_name: str) -> str:
        return (f"{self.name} converts no layer of this model ({model_name}: no Linear layer {self.reach} has both "
                f"dimensions multiples of {self.multiple}); it would measure bf16")

    def census_summary(self, census: dict) -> str:
        called = census["called"]
        return (f"{self.name} ({census['recipe']}) runs {len(called)} of the model's layers in {self.format_name} "
                f"({census['flop_share']:.0%} of its forward FLOPs)"
                + (f": {', '.join(called[:6])}" + (", ..." if len(called) > 6 else "") if called else "")
                + self.frozen_note(census))

    def frozen_note(self, census: dict) -> str:
        n = len(census.get("frozen") or ())
        return (f"; {n} frozen Linear layer(s) it could convert stay bf16 (torchao's {self.format_name} Linear "
                "computes the weight's gradient whether or not the weight trains)") if n else ""

    def census_lines(self, census: dict) -> list[str]:
        if census.get("error"):
            return ["", f"What {self.name} converts could not be counted: {census['error']}."]
        if not census["called"]:
            return ["", f"{self.name} converts no layer of this model (no Linear layer {self.reach} has both "
                    f"dimensions multiples of {self.multiple}{self.frozen_note(census)}), so its {self.name} "
                    "variants measure bf16."]
        text = (f"{self.name} ({census['recipe']}) runs {len(census['called'])} Linear layers in "
                f"{self.format_name}{self.format_how}, {census['flop_share']:.0%} of the model's forward FLOPs"
                f"{self.census_how}; the rest stays bf16{self.frozen_note(census)}.")
        if census.get("small_gemms"):
            text += f" On this model {census['small_gemms']}."
        return ["", text]
