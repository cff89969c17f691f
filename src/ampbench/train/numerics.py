"""fp16 numerics: what fp16 does to each layer's values, and which layer produced an inf/NaN.

- ``fp16_fractions``: the share of values that overflow (become inf), flush to
  zero, or land in fp16's subnormal range, found by really converting them.
- ``audit``: per layer, the dtype autocast ran it in and those shares for its
  activations and for the gradients flowing back into it, without loss scaling
  and at the scale in use (what the scaler rescued).
- ``diagnose``: replays a batch with hooks (off during normal training) to name
  the first module whose output holds inf/NaN and the first parameter whose
  gradient does.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ampbench.errors import first_line
from ampbench.results import NUMERICS_COLUMNS

FP16_MAX = 65504.0          # larger magnitudes overflow to inf
FP16_MIN_NORMAL = 2.0 ** -14  # 6.1e-5: below it fp16 is subnormal and loses precision
FP16_MIN_SUBNORMAL = 2.0 ** -24  # 6e-8: about half of it and below, values flush to zero


def fp16_fractions(t: torch.Tensor, scale: float = 1.0) -> dict[str, float]:
    """Shares of ``t * scale``'s values that overflow, flush to zero, or are subnormal once cast to fp16."""
    v = t.detach().float() * scale
    h = v.half()
    finite, nonzero = torch.isfinite(v), v != 0
    n = max(1, v.numel())
    return {"overflow": (torch.isinf(h) & finite).sum().item() / n,
            "underflow": ((h == 0) & nonzero & finite).sum().item() / n,
            "subnormal": ((h != 0) & (h.abs() < FP16_MIN_NORMAL)).sum().item() / n}


# Modules with children that still compute something of their own: attention's softmax(QK^T)V runs inside
# MultiheadAttention, not in a child, so the audit watches it as a whole.
COMPOSITE = (nn.MultiheadAttention,)


def _leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules the audit watches: every leaf, and composites that compute outside their children."""
    return [(name, m) for name, m in model.named_modules()
            if name and (not list(m.children()) or isinstance(m, COMPOSITE))]


def _first_tensor(out):
    """A module's output tensor: itself, or the first of a tuple (attention returns (output, weights))."""
    return out[0] if isinstance(out, tuple) and out and torch.is_tensor(out[0]) else out


def _without_inplace(model: nn.Module) -> nn.Module:
    """A copy whose in-place activations are out of place, so tensor hooks see every gradient."""
    copy_ = copy.deepcopy(model)
    for m in copy_.modules():
        if hasattr(m, "inplace"):
            m.inplace = False
    return copy_


def audit(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], scale: float,
          device_type: str) -> list[dict]:
    """Per leaf layer: autocast dtype and fp16 overflow/underflow/subnormal shares of activations and gradients."""
    probe = _without_inplace(model).train()
    layers = _leaves(probe)
    rows = {name: {"layer": name, "type": type(m).__name__, "autocast_dtype": None, "values": 0,
                   "frozen": _frozen(m)} for name, m in layers}
    sums: dict[str, dict[str, float]] = {name: {} for name, _ in layers}

    def add(name: str, prefix: str, t: torch.Tensor, s: float, weight: int) -> None:
        for key, frac in fp16_fractions(t, s).items():
            sums[name][f"{prefix}_{key}"] = sums[name].get(f"{prefix}_{key}", 0.0) + frac * weight

    handles = []
    for name, m in layers:
        def dtype_hook(mod, inp, out, name=name):
            out = _first_tensor(out)
            if torch.is_tensor(out):
                rows[name]["autocast_dtype"] = str(out.dtype).replace("torch.", "")
        handles.append(m.register_forward_hook(dtype_hook))
    with torch.no_grad(), torch.autocast(device_type, dtype=torch.float16):
        probe(batches[0][0])
    for h in handles:
        h.remove()

    for x, y in batches:  # the true (fp32) values, then what fp16 would do to them
        handles = []
        for name, m in layers:
            def value_hook(mod, inp, out, name=name):
                out = _first_tensor(out)
                if not torch.is_tensor(out) or not out.is_floating_point():
                    return
                n = out.numel()
                rows[name]["values"] += n
                add(name, "act", out, 1.0, n)
                if out.requires_grad:
                    def grad_hook(g, name=name, n=n):
                        add(name, "grad", g, 1.0, n)
                        add(name, "grad_scaled", g, scale, n)
                    out.register_hook(grad_hook)
            handles.append(m.register_forward_hook(value_hook))
        F.cross_entropy(probe(x.float()), y).backward()
        for h in handles:
            h.remove()
    out = []
    for name, _ in layers:
        n = rows[name]["values"]
        if n:  # one schema for every row: a layer no gradient reaches (frozen, before any trained one) has none
            row = {**rows[name], **{k: None for k in NUMERICS_COLUMNS if k not in rows[name]}}
            out.append({**row, **{k: v / n for k, v in sums[name].items()}})
    return out


def _frozen(m: nn.Module) -> bool:
    """A layer with parameters, none of them trained."""
    params = list(m.parameters(recurse=False))
    return bool(params) and not any(p.requires_grad for p in params)


def nonfinite_state(model: nn.Module, opt: torch.optim.Optimizer | None) -> list[str]:
    """The parameters whose optimizer state (momentum, moments) holds inf/NaN: what an optimizer step left there."""
    if opt is None:
        return []
    names = {id(p): n for n, p in model.named_parameters()}
    return [names.get(id(p), "?") for p, state in opt.state.items()
            if any(torch.is_tensor(v) and v.is_floating_point() and not torch.isfinite(v).all()
                   for v in state.values())]


def diagnose(model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast, scale: float,
             opt: torch.optim.Optimizer | None = None) -> dict:
    """Replay one batch with hooks: the first module whose output is inf/NaN, the first such gradient; and what
    holds inf/NaN already: the weights, the optimizer's state. A replay that cannot be made (a model whose
    MX-wrapped weights have run cannot be copied) says so and never hides the stop."""
    state = nonfinite_state(model, opt)[:5]
    try:
        probe = copy.deepcopy(model).train()
    except Exception as err:
        return {"first_bad_module": None, "first_bad_grad": None, "nonfinite_params": [], "loss": None,
                "nonfinite_state": state, "not_made": f"{type(err).__name__}: {err}"}
    bad_params = [n for n, p in probe.named_parameters() if not torch.isfinite(p).all()]
    first: dict = {"first_bad_module": None, "first_bad_grad": None,
                   "nonfinite_params": bad_params[:5], "nonfinite_state": state, "loss": None}
    handles = []
    for name, m in probe.named_modules():
        def fwd(mod, inp, out, name=name or "<model>"):
            out = _first_tensor(out)
            if first["first_bad_module"] is None and torch.is_tensor(out) and not torch.isfinite(out).all():
                first["first_bad_module"] = name
        handles.append(m.register_forward_hook(fwd))
    for name, p in probe.named_parameters():
        if not p.requires_grad:  # a frozen parameter has no gradient to watch (and takes no hook)
            continue

        def bwd(g, name=name):
            if first["first_bad_grad"] is None and not torch.isfinite(g).all():
                first["first_bad_grad"] = name
        handles.append(p.register_hook(bwd))
    try:  # the replay must never hide the stop it explains (out of memory beside the trained model, say)
        with autocast():
            loss = F.cross_entropy(probe(x), y)
        first["loss"] = float(loss.detach().float())
        (loss * scale).backward()
    except Exception as err:
        first["not_made"] = first_line(err)
    finally:
        for h in handles:
            h.remove()
    return first


def describe(d: dict) -> str:
    """One sentence for an error message."""
    parts = []
    if d.get("nonfinite_state"):
        parts.append(f"optimizer state already non-finite for: {', '.join(d['nonfinite_state'])}")
    if d.get("nonfinite_params"):
        parts.append(f"weights already non-finite: {', '.join(d['nonfinite_params'])}")
    parts.append(f"first module with an inf/NaN output: {d.get('first_bad_module') or 'none found'}")
    parts.append(f"first parameter with an inf/NaN gradient: {d.get('first_bad_grad') or 'none found'}")
    if d.get("not_made"):
        parts = parts[:-2] + [f"the last batch could not be replayed ({d['not_made']})"]
    return "; ".join(parts)


def advice(d: dict, precision: str, optimizer_impl: str, skipped: int = 0) -> str:
    """What to try, for the cause the diagnosis ``d`` found: weights an update wrote (the step's size, or a fused
    kernel's state after skipped steps), an optimizer state gone non-finite under finite weights, an activation
    with finite weights (fp16's range, or the model), a replay that could not be made, or nothing left to see."""
    if d.get("nonfinite_state") and not d.get("nonfinite_params"):
        return ("The optimizer's state is inf/NaN while the weights are finite: an optimizer step wrote it, and the "
                "next will write it into the weights. Set this variant's optimizer_impl: foreach to see whether "
                f"the {optimizer_impl} implementation is the cause; then train.clip_grad_norm (e.g. 1.0) or a lower "
                "train.lr")
    if d.get("nonfinite_params"):
        text = ("An optimizer step wrote inf/NaN weights (the forward pass did not make them): the update was too "
                "large, or the optimizer's state was wrong. ")
        if skipped and optimizer_impl == "fused":
            return text + (f"The GradScaler skipped {skipped} step(s), and a fused kernel skips by returning early, "
                           "leaving its state as it found it: set this variant's optimizer_impl: foreach to rule that "
                           "out first; if it persists, lower train.lr or set train.clip_grad_norm (e.g. 1.0)")
        return text + "Lower train.lr, or set train.clip_grad_norm (e.g. 1.0)"
    module = d.get("first_bad_module")
    if module and precision == "fp16":
        return (f"With finite weights, {module}'s output was inf/NaN: in fp16 that is most often an activation past "
                "fp16's range (65504), which no loss scale helps. Train this variant in bf16 (fp32's range, no loss "
                "scale); if precision: fp32 diverges too, the model itself does: lower train.lr")
    if module:
        return (f"With finite weights, {module}'s output was inf/NaN: the model diverges at this learning rate or "
                "computes a NaN (0/0, log of 0). Lower train.lr, or set debug.detect_anomaly: true to find the op")
    if d.get("not_made"):
        return (f"The last batch could not be replayed to find the cause ({d['not_made']}): set "
                "debug.detect_anomaly: true to stop at the op that produces the first inf/NaN")
    return ("A replay of the last batch was finite throughout, so the cause did not persist: set "
            "debug.detect_anomaly: true to stop at the op that produces the first inf/NaN")
