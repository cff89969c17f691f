"""One-off measurements a train stage takes before training, on one batch: the accumulation check on a copy of the
model, the activation meter on the model itself (its buffers and mode put back).

- ``accumulation_check``: k accumulated micro-batch gradients against one full-batch gradient.
- ``activation_bytes``: the bytes autograd saves for backward in one forward pass.
"""

from __future__ import annotations

import copy

import torch

from ampbench.measure import memory
from ampbench.train import step
from ampbench.train.policy import PrecisionPolicy


def accumulation_check(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int) -> float:
    """Max relative difference between k accumulated micro-batch gradients and one full-batch gradient.

    In fp32, with BatchNorm in eval mode (its batch statistics would differ by
    design), on a copy of the model: the two must agree to rounding. Pass the model
    unconverted (``setup.plain_model``): a converting rung's scales follow each
    micro-batch, so on its layers the check would measure that, not accumulation.
    """
    probe = copy.deepcopy(model).float().eval()
    policy = PrecisionPolicy("fp32", x.device.type, None)
    grads = []
    for size in (len(y), micro):
        probe.zero_grad(set_to_none=True)
        step.accumulate_gradients(probe, x.float(), y, size, policy, policy.scaler())
        grads.append([p.grad.detach().clone() for p in probe.parameters() if p.grad is not None])
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
               for a, b in zip(grads[1], grads[0], strict=True))


def activation_bytes(model: torch.nn.Module, x: torch.Tensor, policy: PrecisionPolicy) -> int:
    """Bytes autograd saves for backward in one forward pass of ``x`` in training mode. The model's buffers
    (BatchNorm's running statistics) and mode are put back after it; no copy of the model is made (a weight MX
    training wraps cannot be deep-copied once it has run, and a copy would double the model's memory)."""
    # the micro-batch as a tensor of its own: a view of a larger one (a chunk of batches, the batch it splits)
    # saved for backward would count that whole storage as this pass's activations
    x = x.clone()
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    was_training = model.training
    meter = memory.SavedTensorMeter(exclude=list(model.parameters()))
    try:
        with meter.measure(), policy.autocast():
            out = model.train()(x)
        del out
    finally:
        with torch.no_grad():
            for b, kept in buffers:
                b.copy_(kept)
        model.train(was_training)
    return meter.bytes
