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

from ampbench import models
from ampbench.precision import PrecisionPolicy, set_tf32
from ampbench.runplan import RunPlan
from ampbench.train import distributed


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


def optimizer(plan: RunPlan, params) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum and weight decay, as params.yaml's train section sets it."""
    t = plan.train
    return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay, nesterov=True)


def lr_lambda(total_steps: int):
    """Linear warm-up over the first 5% of optimizer steps, then cosine decay to zero."""
    warm = max(1, round(0.05 * total_steps))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def schedule(opt: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning-rate schedule over ``total_steps`` optimizer steps (advanced only on steps taken)."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps))


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
