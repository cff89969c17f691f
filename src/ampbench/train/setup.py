"""One builder from a RunPlan to what trains it: ``build(plan, meta, device, world) -> Setup``.

The trainer, the batch-size sweep and the step profile all build their model, optimizer, precision policy,
GradScaler and step model (compiled when asked, inside DDP under several processes) here, so the three
measure the same thing; ``schedule`` gives the trainer its learning-rate schedule over a known number of
optimizer steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ampbench import models
from ampbench.config import optim
from ampbench.precision import rung, set_tf32
from ampbench.runplan import RunPlan
from ampbench.train import distributed, fsdp
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
    # under FSDP with train.compile: (the blocks compiled, those left eager), as ``fsdp.compile_blocks`` did them
    compiled_blocks: tuple[list[str], list[str]] = ([], [])

    def load_state(self, model: dict, opt: dict, scaler: dict) -> None:
        """Start from another setup's state (a checkpoint's, or the trained model's for the profile); under FSDP a
        checkpoint's whole state is sharded over the ranks as it is loaded."""
        if fsdp.is_sharded(self.model) and not fsdp.holds_shards(model):
            fsdp.load_full_state(self.model, self.opt, model, opt, self.plan.precision)
        else:
            self.model.load_state_dict(model)
            self.opt.load_state_dict(opt)
        if self.policy.uses_scaler:
            self.scaler.load_state_dict(scaler)


def optimizer(plan: RunPlan, params, impl: str | None = None) -> torch.optim.Optimizer:
    """params.yaml's train.optimizer (an entry of ``train.optim``'s registry) over ``params``, in the plan's
    implementation (``impl`` overrides it: the roofline counts on meta tensors, which only foreach and for_loop
    run on): ``fused`` (one kernel for the whole update), ``foreach`` (multi-tensor kernels) or ``for_loop`` (one
    parameter at a time)."""
    entry = optim.info(plan.train.optimizer)
    impl = impl or plan.train.optimizer_impl
    if impl == "auto":
        impl = entry.auto_impl(plan.device, plan.amp is not None and rung(plan.precision).grad_scaler)
    return entry.make(params, plan.train, impl)


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
    sharded = plan.strategy == "fsdp" and world.active
    policy = PrecisionPolicy(plan.precision, device.type, plan.amp, plan.recipe, plan.model.convert_ends, sharded)
    input_size = models.input_size(plan.model, meta["image_shape"][-1])
    model = policy.prepare(models.build(plan.model, num_classes=meta["num_classes"], image_size=input_size,
                                             device=device))
    compiled = ([], [])
    if sharded:  # before the optimizer, which takes the shards
        if plan.train.compile:  # each block's forward, its FSDP hooks eager around it
            compiled = fsdp.compile_blocks(model, plan.precision, plan.fsdp_reduce_dtype)
        fsdp.shard(model, world, device.type, plan.precision, plan.fsdp_reduce_dtype)
    # over the trained parameters only, as fine-tuning recipes build it: a frozen one gets no state (SGD's momentum)
    opt = optimizer(plan, [p for p in model.parameters() if p.requires_grad])
    if sharded:
        fsdp.after_each_step(model, opt, plan.precision)
    return Setup(plan=plan, policy=policy, model=model, opt=opt, scaler=policy.scaler(),
                 step_model=model if sharded else distributed.step_model(model, world, plan), input_size=input_size,
                 compiled_blocks=compiled)


def plain_model(s: Setup, meta: dict, device: torch.device) -> torch.nn.Module:
    """The model in plain arithmetic, for the measurements around training: the one trained, or for a rung that
    converts layers a fresh build left unconverted. Its FLOPs are the same (a converted model's fp8 GEMMs refuse a
    count's small batch: MX everywhere, CUDA's fp8 where images x tokens is not a multiple of 16), and its gradients
    are what the accumulation check compares (fp8 scales each micro-batch by its own amax: on a converted copy the
    check would measure fp8's scaling, not the accumulation)."""
    if not s.policy.rung.converts and not fsdp.is_sharded(s.model):
        return s.model  # (a sharded one's every pass is a collective: an analysis gets a whole copy)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # training's draws unchanged
        return models.build(s.plan.model, num_classes=meta["num_classes"], image_size=s.input_size, device=device,
                            pretrained=False)  # its values are not what it is built for


def whole_copy(s: Setup, meta: dict, device: torch.device, state: dict) -> torch.nn.Module:
    """An unsharded copy of a sharded setup's model holding ``state`` (its whole state, ``fsdp.full_state``'s), for
    an analysis one rank runs alone (every pass of the sharded model is a collective)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # training's draws unchanged
        unsharded = dataclasses.replace(s.policy, sharded=False)  # its fp8 weights cast as one process casts them
        model = unsharded.prepare(models.build(s.plan.model, num_classes=meta["num_classes"], image_size=s.input_size,
                                          device=device, pretrained=False))
    model.load_state_dict(state)
    return model
