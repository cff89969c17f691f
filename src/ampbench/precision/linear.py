"""What the rungs that convert a model's Linear layers (fp8, mxfp8) share: the census's words, the rule that a
run converting nothing ran in bf16, and that a GPU without the rung's tensor cores cannot run it at all."""

from __future__ import annotations

from dataclasses import dataclass

from ampbench.precision import Rung


def layer_count(n) -> str:
    return "missing" if n is None else format(n, "d")


@dataclass(frozen=True)
class LinearRung(Rung):
    """A rung whose eligible Linear layers (both dimensions multiples of ``multiple``) run in a low format."""

    multiple: int = 16
    format_name: str = "float8"           # what the converted GEMMs run in, as the report says it
    reach: str = "it calls"               # which Linear layers count: those a forward calls, or whose weight it uses
    format_how: str = ""                  # the format's words in the report, after its name
    census_how: str = ""                  # how the census found the layers, for the report

    def measured_column(self, converted: int | None) -> str:
        return self.datasheet if converted else "bf16"  # a run that converted nothing ran in bf16

    def runs_on(self, row: dict) -> bool:
        return bool(row.get(self.datasheet))  # without its tensor cores, not at all, whatever the model

    def no_layer(self, model_name: str) -> str:
        return (f"{self.name} converts no layer of this model ({model_name}: no Linear layer {self.reach} has both "
                f"dimensions multiples of {self.multiple}); it would measure bf16")

    def census_summary(self, census: dict) -> str:
        called = census["called"]
        return (f"{self.name} ({census['recipe']}) runs {len(called)} of the model's layers in {self.format_name} "
                f"({census['flop_share']:.0%} of its forward FLOPs)"
                + (f": {', '.join(called[:6])}" + (", ..." if len(called) > 6 else "") if called else ""))

    def census_lines(self, census: dict) -> list[str]:
        if census.get("error"):
            return ["", f"What {self.name} converts could not be counted: {census['error']}."]
        if not census["called"]:
            return ["", f"{self.name} converts no layer of this model (no Linear layer {self.reach} has both "
                    f"dimensions multiples of {self.multiple}), so its {self.name} variants measure bf16."]
        text = (f"{self.name} ({census['recipe']}) runs {len(census['called'])} Linear layers in "
                f"{self.format_name}{self.format_how}, {census['flop_share']:.0%} of the model's forward FLOPs"
                f"{self.census_how}; the rest stays bf16.")
        if census.get("small_gemms"):
            text += f" On this model {census['small_gemms']}."
        return ["", text]
