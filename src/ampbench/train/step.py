"""One optimizer step, as PyTorch's AMP recipe writes it: what the loop times, the profile profiles and the
probes check.

``accumulate_gradients`` runs the forward and backward passes of a batch in
micro-batches; ``train_step`` adds the zeroing, the scaler's step and update.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ampbench.train import distributed
from ampbench.train.policy import PrecisionPolicy


def accumulate_gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int,
                         policy: PrecisionPolicy, scaler: torch.amp.GradScaler, weight: float = 1.0) -> torch.Tensor:
    """Forward and backward ``x`` in micro-batches of ``micro``; return the batch's mean loss (on the device).

    Each micro-batch's mean loss is weighted by its share of the batch, so the
    summed gradients equal those of one full-batch step (for a short last
    micro-batch too). With accum_steps = 4 that is the article's "divide the
    loss by accum_steps". On a DDP model every micro-batch but the last runs
    under ``no_sync()``, so the gradients are all-reduced once per optimizer
    step; ``weight`` (this rank's share of the global batch times the world
    size) keeps DDP's average over ranks equal to the global batch's mean when
    the ranks' slices differ in size.
    """
    n = y.shape[0]
    if micro >= n:  # one micro-batch (no accumulation): the recipe's three lines, nothing around them
        with policy.autocast():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss * weight if weight != 1 else loss).backward()
        return loss.detach()
    losses = []
    parts = list(zip(x.split(micro), y.split(micro), strict=True))
    for i, (xs, ys) in enumerate(parts):
        with distributed.sync_context(model, sync=i == len(parts) - 1):
            with policy.autocast():
                out = model(xs)
                loss = F.cross_entropy(out, ys)  # autocast computes it in fp32
                if len(ys) != n:
                    loss = loss * (len(ys) / n)
            # scaled (fp16) so small gradients do not flush to zero
            scaler.scale(loss * weight if weight != 1 else loss).backward()
        losses.append(loss.detach())
    return losses[0] if len(losses) == 1 else torch.stack(losses).sum()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               policy: PrecisionPolicy, x: torch.Tensor, y: torch.Tensor, micro: int,
               weight: float = 1.0, clip: float = 0.0, norms: list | None = None) -> torch.Tensor:
    """One optimizer step, as PyTorch's AMP recipe writes it; the batch's mean loss, left on the device.

    ``clip`` > 0 clips the gradients' total norm to it; with ``norms`` (a list) the total norm before clipping is
    appended to it, a device tensor (no sync). Either way it happens once per optimizer step, after the last
    micro-batch (and DDP's all-reduce, which that micro-batch's backward waits for), and under fp16 after
    ``scaler.unscale_``: clipping the scaled gradients would clip at ``clip`` times the loss scale (pytorch
    #40907). ``scaler.step`` then does not unscale twice, and still skips a step whose gradients hold inf/NaN
    (its norm is inf or NaN). The training loop and the step profile both run this, so the profile shows the
    step that was timed.
    """
    opt.zero_grad(set_to_none=True)
    with policy.kernels():  # the backward passes too, which run outside autocast
        loss = accumulate_gradients(model, x, y, micro, policy, scaler, weight)
    if clip or norms is not None:
        scaler.unscale_(opt)  # a no-op on a disabled scaler
        grads = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        norm = (torch.nn.utils.clip_grad_norm_(grads, clip) if clip
                else torch.nn.utils.get_total_norm([p.grad for p in grads]))
        if norms is not None:  # under FSDP a DTensor over the shards: its value is the whole gradient's norm
            norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    scaler.step(opt)  # unscales (if not done above), and skips the update if any gradient is inf/NaN
    scaler.update()   # once per optimizer step, not per micro-batch
    return loss
