"""How a run applies its precision: the autocast context, the GradScaler, the TF32 switches.

The engine asks a ``PrecisionPolicy`` for an autocast context and a scaler; a disabled scaler is a no-op, so the
loop has one code path for every precision. What each precision means is its rung's (``ampbench.precision``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from ampbench.config import AmpConfig
from ampbench.precision import RUNGS, Rung


def dtype(name: str) -> torch.dtype:
    """The dtype a precision computes its autocast-eligible ops in (fp32 for one with no autocast)."""
    a = RUNGS[name].autocast
    return getattr(torch, a) if a else torch.float32


_NO_CONTEXT = nullcontext()  # reusable: entered by every step of a rung on the default kernels


@dataclass(frozen=True)
class PrecisionPolicy:
    precision: str          # a registered rung
    device_type: str        # cuda | cpu
    amp: AmpConfig | None   # GradScaler settings, used only by a precision that needs a scaler
    recipe: str | None = None  # a converting rung's recipe
    convert_ends: bool = False  # a converting rung converts the model's first layer and classifier head too
    sharded: bool = False   # the model will be sharded by FSDP: fp8's weights all-gathered in fp8

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model as this precision trains it (a converting rung: its eligible layers converted)."""
        # ``sharded`` only when set: a family written before FSDP (its prepare without it) keeps working unsharded
        return self.rung.prepare(model, self.recipe, self.convert_ends, **({"sharded": True} if self.sharded else {}))

    def census(self, model: nn.Module, image_size: int) -> dict | None:
        """What this precision converts in ``model`` (unconverted), as ``prepare`` converts it; None if nothing."""
        return self.rung.census(model, self.recipe, image_size, self.convert_ends)

    @cached_property  # read every step: looked up once (the policy is frozen)
    def rung(self) -> Rung:
        return RUNGS[self.precision]

    @cached_property
    def dtype(self) -> torch.dtype:
        return dtype(self.precision)

    @cached_property
    def uses_autocast(self) -> bool:
        return self.rung.autocast is not None

    @cached_property
    def _plain_kernels(self) -> bool:
        """The rung runs its ops on the default kernels (no context around a step): most do."""
        return type(self.rung).kernels is Rung.kernels

    @property
    def uses_scaler(self) -> bool:
        return self.rung.grad_scaler

    def autocast(self) -> AbstractContextManager:
        """The forward-pass context: autocast to the precision's dtype, or a disabled one, with the rung's kernels
        (``kernels``)."""
        cast = torch.autocast(self.device_type, dtype=self.dtype, enabled=self.uses_autocast)
        if self._plain_kernels:  # the common case, per step: nothing around autocast
            return cast
        stack = ExitStack()
        stack.enter_context(self.kernels())
        stack.enter_context(cast)
        return stack

    def kernels(self) -> AbstractContextManager:
        """The context a step's forward and backward passes run in: which kernels serve the rung's ops here (fp8
        on a CPU: torch._scaled_mm's emulated kernel, not oneDNN's)."""
        return _NO_CONTEXT if self._plain_kernels else self.rung.kernels(self.device_type)

    def scaler(self) -> torch.amp.GradScaler:
        """A GradScaler from params.yaml's ``amp`` section; disabled (a no-op) unless the precision needs one."""
        if not self.uses_scaler:
            return torch.amp.GradScaler(self.device_type, enabled=False)
        a = self.amp or AmpConfig()
        return torch.amp.GradScaler(self.device_type, init_scale=a.init_scale, growth_factor=a.growth_factor,
                                    backoff_factor=a.backoff_factor, growth_interval=a.growth_interval)
