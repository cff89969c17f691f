"""One optimizer step, as PyTorch's AMP recipe writes it: what the loop times, the profile profiles and the
probes check.

``accumulate_gradients`` runs the forward and backward passes of a batch in
micro-batches; ``train_step`` adds the zeroing, the scaler's step and update.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ampbench.precision import PrecisionPolicy


def accumulate_gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int,
                         policy: PrecisionPolicy, scaler: torch.amp.GradScaler) -> torch.Tensor:
    """Forward and backward ``x`` in micro-batches of ``micro``; return the batch's mean loss (on the device).

    Each micro-batch's mean loss is weighted by its share of the batch, so the
    summed gradients equal those of one full-batch step (for a short last
    micro-batch too). With accum_steps = 4 that is the article's "divide the
    loss by accum_steps".
    """
    n = len(y)
    losses = []
    for xs, ys in zip(x.split(micro), y.split(micro), strict=True):
        with policy.autocast():
            out = model(xs)
            loss = F.cross_entropy(out, ys)  # autocast computes it in fp32
            if len(ys) != n:
                loss = loss * (len(ys) / n)
        scaler.scale(loss).backward()  # scaled (fp16) so small gradients do not flush to zero
        losses.append(loss.detach())
    return losses[0] if len(losses) == 1 else torch.stack(losses).sum()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               policy: PrecisionPolicy, x: torch.Tensor, y: torch.Tensor, micro: int) -> torch.Tensor:
    """One optimizer step, as PyTorch's AMP recipe writes it; the batch's mean loss, left on the device.

    The training loop and the step profile both run this, so the profile shows the step that was timed.
    """
    opt.zero_grad(set_to_none=True)
    loss = accumulate_gradients(model, x, y, micro, policy, scaler)
    scaler.step(opt)  # unscales, and skips the update if any gradient is inf/NaN
    scaler.update()   # once per optimizer step, not per micro-batch
    return loss
