"""One builder from a RunPlan to what trains it: ``build(plan, meta, device, world) -> Setup``.

The trainer, the batch-size sweep and the step profile all build their model, optimizer, precision policy,
GradScaler and step model (compiled when asked, inside DDP under several processes) here, so the three
measure the same thing; ``schedule`` gives the trainer its learning-rate schedule over a known number of
optimizer steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ampbench import config, models
from ampbench.precision import set_tf32
from ampbench.runplan import RunPlan
from ampbench.train import distributed
from ampbench.train.policy import PrecisionPolicy


@dataclass
class Setup:
    plan: RunPlan
    policy: PrecisionPolicy        # autocast dtype and GradScaler, from the plan's precision
    model: nn.Module               # the module that holds the weights (prepared for the precision)
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler   # disabled (a no-op) unless the precision needs one
    step_model: nn.Module          # what a step calls: the model, compiled or not, inside DDP under torchrun
    input_size: int                # the side of the images the model takes

    def load_state(self, model: dict, opt: dict, scaler: dict) -> None:
        """Start from another setup's state (a checkpoint's, or the trained model's for the profile)."""
        self.model.load_state_dict(model)
        self.opt.load_state_dict(opt)
        if self.policy.uses_scaler:
            self.scaler.load_state_dict(scaler)


def optimizer(plan: RunPlan, params, impl: str | None = None) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum and L2 weight decay, or AdamW (decoupled weight decay), as params.yaml's train
    section sets it, in the plan's implementation (``impl`` overrides it: the roofline counts on meta tensors,
    which only foreach and for_loop run on): ``fused`` (one kernel for the whole update), ``foreach``
    (multi-tensor kernels) or ``for_loop`` (one parameter at a time)."""
    t = plan.train
    impl = impl or config.resolve_optimizer_impl(t.optimizer_impl, plan.device)
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[impl]
    if t.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay,
                                 **kind)
    return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay, nesterov=True,
                           **kind)


def skips_on_device(opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> bool:
    """Whether an enabled GradScaler steps ``opt`` with its skip decided on the device: a fused optimizer's
    ``step()`` always runs and leaves the weights (and its step count) unchanged where a gradient was inf/NaN,
    with no host sync, so the host learns of a skip only at its next sync."""
    return scaler.is_enabled() and bool(opt.defaults.get("fused"))


def lr_lambda(total_steps: int):
    """Linear warm-up over the first 5% of optimizer steps, then cosine decay to zero."""
    warm = max(1, round(0.05 * total_steps))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def schedule(opt: torch.optim.Optimizer, total_steps: int, scaler: torch.amp.GradScaler | None = None):
    """The learning-rate schedule over ``total_steps`` optimizer steps, advanced only on steps taken: on the host
    (``LambdaLR``, stepped when a step was taken), or on the device where only the device knows
    (``DeviceSchedule``, stepped every step with the scaler's found-inf flag)."""
    if scaler is not None and skips_on_device(opt, scaler):
        return DeviceSchedule(opt, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps))


class DeviceSchedule:
    """``lr_lambda``'s warm-up and cosine schedule, followed on the device from the steps really taken.

    A fused optimizer stepped by an enabled GradScaler skips an overflowing step on the device; a host schedule
    would run one step ahead from there until the next sync. Here each param group's ``lr`` is a 0-d float32
    tensor on the device (fused kernels read it there), and ``step(found_inf)`` adds ``1 - found_inf`` to the
    count of steps taken and writes ``base_lr * lr_lambda(taken)`` into it: a few scalar kernels, no sync. Exact
    whatever the sync points, so a resumed run follows the same schedule as an uninterrupted one.
    """

    def __init__(self, opt: torch.optim.Optimizer, total_steps: int):
        self.opt, self.total = opt, total_steps
        self.warm = max(1, round(0.05 * total_steps))
        device = next(p.device for g in opt.param_groups for p in g["params"])
        self.base_lrs = [float(g["lr"]) for g in opt.param_groups]
        self.taken = torch.zeros((), dtype=torch.float64, device=device)
        for g, base in zip(opt.param_groups, self.base_lrs, strict=True):
            g["lr"] = torch.tensor(base, dtype=torch.float32, device=device)
        self._write()

    def _write(self) -> None:
        s = self.taken
        progress = ((s - self.warm) / max(1, self.total - self.warm)).clamp(max=1.0)
        factor = torch.where(s < self.warm, (s + 1) / self.warm, 0.5 * (1 + torch.cos(math.pi * progress)))
        for g, base in zip(self.opt.param_groups, self.base_lrs, strict=True):
            g["lr"].copy_(factor * base)

    def step(self, found_inf: torch.Tensor) -> None:
        self.taken += 1 - found_inf.to(self.taken.dtype)
        self._write()

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.opt.param_groups]  # a sync: read where the loop syncs anyway

    def state_dict(self) -> dict:
        return {"taken": int(self.taken.item())}

    def load_state_dict(self, state: dict) -> None:
        """After the optimizer's own load (which brings back its groups' saved ``lr``): fresh device tensors."""
        self.taken.fill_(state["taken"])
        for g in self.opt.param_groups:
            g["lr"] = torch.zeros((), dtype=torch.float32, device=self.taken.device)
        self._write()


def build(plan: RunPlan, meta: dict, device: torch.device,
          world: distributed.World = distributed.SINGLE) -> Setup:
    """A fresh model (seeded by the plan), its optimizer, policy, scaler and step model on ``device``.

    ``meta``: the prepared data's meta.json (classes, image shape). Also sets what the process runs under:
    the TF32 flags of the plan, and cuDNN's autotuner on CUDA (the shapes are fixed, so the fastest
    convolution kernels are picked once and kept).
    """
    torch.manual_seed(plan.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    set_tf32(plan.train.allow_tf32)
    policy = PrecisionPolicy(plan.precision, device.type, plan.amp, plan.fp8_recipe)
    input_size = models.input_size(plan.model, meta["image_shape"][-1])
    model = policy.prepare(models.build(plan.model, num_classes=meta["num_classes"], image_size=input_size,
                                             device=device))
    opt = optimizer(plan, model.parameters())
    return Setup(plan=plan, policy=policy, model=model, opt=opt, scaler=policy.scaler(),
                 step_model=distributed.step_model(model, world, plan), input_size=input_size)


def flops_model(s: Setup, meta: dict, device: torch.device) -> torch.nn.Module:
    """The model its FLOPs are counted on: the one trained, or for a rung that converts layers a fresh build left
    unconverted (the same FLOPs; a converted model's fp8 GEMMs refuse a count's small batch: MX everywhere, CUDA's
    fp8 where images x tokens is not a multiple of 16)."""
    if not s.policy.spec.converts:
        return s.model
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # training's draws unchanged
        return models.build(s.plan.model, num_classes=meta["num_classes"], image_size=s.input_size, device=device)
