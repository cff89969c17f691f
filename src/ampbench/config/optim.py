"""The optimizer registry: one ``OptimInfo`` entry per optimizer ``train.optimizer`` can name (timm's ``OptimInfo``).

An entry owns what the optimizer means to this project: its class in ``torch.optim`` and the arguments it takes
from params.yaml's train section, its own lr and weight decay where params.yaml leaves them out, the largest lr
that is not another optimizer's brought over, the implementations torch has for it (fused, foreach, for_loop) and
whether its fused kernel skips an overflowing step cleanly under an enabled GradScaler, the fp32 state it keeps
for a parameter of a given shape (what the memory model and the data placement read before anything is built),
and the report's words for it. Everything else asks this registry. It lives beside the params schema, which
checks ``train.optimizer`` and its lr against it, and imports no torch (the report stage reads the schema and
reaches no training code): ``make`` imports torch when an optimizer is built.

A new optimizer is one ``register(OptimInfo(...))`` line below.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

IMPLS = ("fused", "foreach", "for_loop")  # fused: one kernel for the update; foreach: multi-tensor kernels


@dataclass(frozen=True)
class OptimInfo:
    name: str                       # train.optimizer
    cls: str                        # its class in torch.optim
    label: str                      # the report's words for it
    kwargs: Callable[[Any], dict]   # the class's arguments from params.yaml's train section (lr aside)
    state: Callable[[tuple, Any], int]  # fp32 values of state it keeps for a parameter of this shape
    state_words: str                # how its state grows, for the report's memory section
    defaults: dict = field(default_factory=dict)  # lr and weight decay where params.yaml leaves them out
    max_lr: float | None = None     # above it, the lr is another optimizer's brought over (it diverges)
    impls: tuple[str, ...] = IMPLS  # the implementations torch has for it
    fused_skips_cleanly: bool = True  # its fused kernel leaves every state untouched on GradScaler's found-inf
    prime: Callable[[Any], None] | None = None  # run on a new optimizer: its state made before the first step

    def auto_impl(self, device: str, scaled: bool) -> str:
        """``train.optimizer_impl: auto``: fused on CUDA (one kernel for the whole update) where torch has it and
        it skips an overflowing fp16 step cleanly; foreach (multi-tensor kernels) otherwise."""
        fused = "fused" in self.impls and (self.fused_skips_cleanly or not scaled)
        return "fused" if device == "cuda" and fused else "foreach"

    def make(self, params, train, impl: str):
        """The optimizer over ``params`` in implementation ``impl``, as ``train`` (params.yaml's train section)
        sets it."""
        import torch

        kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[impl]
        opt = getattr(torch.optim, self.cls)(params, lr=train.lr, **self.kwargs(train), **kind)
        if self.prime is not None:
            self.prime(opt)
        return opt


def _numel(shape: tuple) -> int:
    return math.prod(shape)


def _factored(shape: tuple) -> int:
    """Adafactor's second moment of a parameter with two or more dimensions: a row and a column factor over its
    last two (rows + columns for a Linear); a full copy for a bias."""
    if len(shape) < 2:
        return _numel(shape)
    lead = _numel(shape[:-2])
    return lead * shape[-2] + lead * shape[-1]


REGISTRY: dict[str, OptimInfo] = {}


def register(info: OptimInfo) -> OptimInfo:
    REGISTRY[info.name] = info
    return info


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def info(name: str) -> OptimInfo:
    return REGISTRY[name]


def state_bytes(name: str, shapes, train) -> int:
    """Bytes of fp32 state the optimizer keeps for parameters of these shapes (its step counters included)."""
    return 4 * sum(REGISTRY[name].state(tuple(s), train) for s in shapes)


def for_count(params, train):
    """``train``'s optimizer over ``params`` as the op counter runs it on meta tensors (foreach: fused kernels
    take no meta tensors; the step it counts is the same arithmetic)."""
    return info(train.optimizer).make(params, train, "foreach")


def training_bytes(shapes, train, frozen=()) -> int:
    """What training holds for trained parameters of these shapes whatever the batch: fp32 weights and gradients,
    and the state ``train.optimizer`` keeps; for ``frozen`` ones their weights alone (the memory model of the data
    placement, before anything is built)."""
    return 8 * sum(_numel(tuple(s)) for s in shapes) + 4 * sum(_numel(tuple(s)) for s in frozen) \
        + state_bytes(train.optimizer, shapes, train)


def _zero_momentum(opt) -> None:
    """SGD's momentum buffers, zero, before its first step. torch's SGD allocates them on its first step
    (``is_first_step``: ``torch.empty_like`` in the fused path, a copy of the gradient in the others); its fused
    kernel, handed GradScaler's found-inf for an overflowing first step, returns without writing them, and the
    uninitialised memory becomes the momentum. With dampening 0 (always here) a zero buffer gives the first step's
    own rule: momentum x 0 + gradient = the gradient, in every implementation."""
    import torch

    for group in opt.param_groups:
        if group["momentum"]:
            for p in group["params"]:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


register(OptimInfo(
    "sgd", "SGD", "SGD with Nesterov momentum",
    kwargs=lambda t: {"momentum": t.momentum, "weight_decay": t.weight_decay, "nesterov": t.momentum > 0},
    state=lambda shape, t: _numel(shape) if t.momentum > 0 else 0,
    state_words="SGD's momentum: one value per parameter",
    defaults={"lr": 0.1, "weight_decay": 5e-4}, prime=_zero_momentum))
register(OptimInfo(
    "adamw", "AdamW", "AdamW (decoupled weight decay)",
    kwargs=lambda t: {"betas": tuple(t.betas), "eps": t.eps, "weight_decay": t.weight_decay},
    state=lambda shape, t: 2 * _numel(shape) + 1,  # two moments and a step count
    state_words="AdamW's two moments: two values per parameter",
    defaults={"lr": 1e-3, "weight_decay": 0.05}, max_lr=0.01))
register(OptimInfo(
    "adafactor", "Adafactor", "Adafactor (factored second moment)",
    kwargs=lambda t: {"weight_decay": t.weight_decay},
    state=lambda shape, t: _factored(shape) + 1,  # row and column factors (a bias: a full copy) and a step count
    state_words="Adafactor's second moment, factored over each weight's last two dimensions: rows + columns",
    defaults={"lr": 1e-2, "weight_decay": 0.01}, max_lr=0.05, impls=("foreach", "for_loop")))
