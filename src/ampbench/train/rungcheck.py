"""A converting rung (fp8, mxfp8) checked against the model it converts: ``check-model``'s and the zoo's
``<rung> conformance`` row.

The converted model's logits must match the unconverted model's (both under the rung's autocast) within the
tolerance the rung declares from its format (``LinearRung.tolerance``), every trainable parameter must get a
gradient, and every tensor cast to the low format must be of a dtype the rung's CUDA kernels take. A dropped bias,
a weight that stops training or a cast that skips autocast fails here, where the emulated recipe would otherwise run
on a CPU and train a different model. The bias of every layer the rung converts is drawn anew first, as
``nn.Linear`` draws it, and a weight of zeros (ViT's head) too: torchvision's zero or 1e-6 biases would hide a
dropped one, a zero head every difference.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from ampbench import models
from ampbench.precision import rung


def _unhide(model: nn.Module, converts: set[str], seed: int) -> None:
    """The bias of each layer in ``converts`` drawn as ``nn.Linear`` draws it, and any Linear weight of zeros."""
    g = torch.Generator().manual_seed(seed)

    def draw(t, fan_in):
        bound = 1 / math.sqrt(fan_in)
        t.copy_(torch.rand(t.shape, generator=g) * 2 * bound - bound)
    with torch.no_grad():
        for n, m in model.named_modules():
            if isinstance(m, nn.Linear):
                if not m.weight.any():
                    draw(m.weight, m.in_features)
                if m.bias is not None and n in converts:
                    draw(m.bias, m.in_features)


def check(model_cfg, name: str, recipe: str, size: int, num_classes: int, batch: int, device: torch.device,
          seed: int = 0) -> tuple[bool | None, str, dict]:
    """``(ok, detail, figures)`` of rung ``name`` with ``recipe`` on ``model_cfg``'s model at ``batch`` images."""
    r = rung(name)
    torch.manual_seed(seed)
    model = models.build(model_cfg, num_classes=num_classes, image_size=size, device=device)
    called = r.census(model, recipe, size, model_cfg.convert_ends)["called"]
    _unhide(model, set(called), seed)
    layers = len(called)
    if not layers:
        return None, f"converts no layer here: nothing to check ({name} would measure bf16)", {}
    converted = r.prepare(copy.deepcopy(model), recipe, model_cfg.convert_ends)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    y = torch.randint(0, num_classes, (batch,), generator=g).to(device)
    dtype = getattr(torch, r.autocast)

    def logits(m):  # in training mode (a fresh model's eval-mode batch norms can give ~0), the same dropout masks
        torch.manual_seed(seed)
        with torch.no_grad(), torch.autocast(device.type, dtype):
            return m.train()(x).float()
    ref = logits(model)
    with r.kernels(device.type), r.operand_spy() as seen:
        got = logits(converted)
        with torch.autocast(device.type, dtype):
            loss = F.cross_entropy(converted(x).float(), y)
        loss.backward()
    err = float((got - ref).norm() / ref.norm())
    tol, why = r.tolerance(layers)
    no_grad = [n for n, p in converted.named_parameters() if p.requires_grad and p.grad is None]
    cast = sorted({str(d).removeprefix("torch.") for d in seen})
    wrong = [d for d in cast if r.operand_dtypes and d not in r.operand_dtypes]
    ok = err <= tol and not no_grad and not wrong and math.isfinite(err)
    detail = (f"logits {err:.4f} from the unconverted model's (relative; tolerance {tol:.3f} = {why})"
              + ("" if err <= tol else ": FAR") + "; "
              + (f"{len(no_grad)} trainable parameter(s) get no gradient, e.g. {no_grad[0]}" if no_grad
                 else "every trainable parameter gets a gradient")
              + (f"; casts to {r.format_name} take {', '.join(cast)}" if cast else "")
              + (f", and its CUDA kernels take {', '.join(r.operand_dtypes)} only" if wrong else ""))
    return ok, detail, {"error": err, "tolerance": tol, "layers": layers, "no_grad": no_grad, "cast": cast}
