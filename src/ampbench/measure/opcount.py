"""The op counter: one training step of a model, op by op, on meta tensors.

``count(model, x, y, precision, optimizer)`` runs one training step (forward, loss, backward, optimizer step) on
meta tensors, which hold shapes and dtypes but no data, so a ResNet-18 step at batch 256 costs milliseconds on
any CPU. A ``TorchDispatchMode`` sees every aten op below autograd and records its FLOPs (torch's own
``flop_counter`` formulas: convolutions, matmuls, attention) and the bytes it reads and writes (each tensor
argument and result once, views free).

CUDA autocast is played by ``measure.cuda_autocast`` (a meta tensor has no autocast).
Attention is counted as the fused kernel a GPU runs (memory-efficient attention), not the math path meta tensors
would take. fp16 adds GradScaler's unscale pass over the gradients. fp8 converts the model as training does (torchao's
float8 Linear layers: their GEMMs run on float8 tensors), and its scaling is counted as ``torch.compile`` fuses it
(an amax pass and a cast pass per tensor; torchao's fp8 is only fast compiled), everything else as eager.

The optimizer is passed in (``make_optimizer``): what trains the model is training's to build.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ampbench.measure.cuda_autocast import Autocast, cannot_count

CATEGORIES = ("conv", "matmul", "attention", "memory-bound ops")


@dataclass
class Op:
    name: str          # the aten op, or "cast" / "unscale (GradScaler)"
    dtype: str         # the dtype its math runs in: float32, float16, bfloat16, float8
    flops: float
    bytes: float
    phase: str         # forward | backward | optimizer
    kernels: int = 1   # the CUDA kernels it launches (a foreach op: one per chunk of tensors; a conv backward: 2+)

    @property
    def category(self) -> str:
        if not self.flops:
            return "memory-bound ops"
        if "conv" in self.name:
            return "conv"
        return "attention" if "attention" in self.name else "matmul"


def _float8_data(t: torch.Tensor) -> torch.Tensor | None:
    """The fp8 payload of a torchao float8 training tensor (a subclass whose dtype says its original one)."""
    data = getattr(t, "_data", None)
    return data if isinstance(data, torch.Tensor) and data.dtype.itemsize == 1 and data.is_floating_point() else None


def _bytes(t: torch.Tensor) -> int:
    """The memory a tensor spans (an expanded tensor reads its storage once; a float8 tensor its fp8 bytes)."""
    data = _float8_data(t)
    if data is not None:
        t = data
    if t.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True) if stride)
    return min(span, t.numel()) * t.element_size()


_NO_TRAFFIC = frozenset(("_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "detach",
                         "_record_function_enter_new", "_record_function_exit", "lift_fresh"))


# ATen's multi-tensor apply (MultiTensorApply.cuh, the 4 KB kernel-argument limits): a foreach op launches one kernel
# per this many tensors (by how many tensor lists it takes) or per this many 64K-element chunks, whichever fills
# first (builds with larger kernel arguments launch fewer)
FOREACH_MAX_TENSORS = (110, 64, 48, 36, 30)
FOREACH_MAX_BLOCKS, FOREACH_CHUNK = 320, 65536


BATCH_NORM_BACKWARD = ("native_batch_norm_backward", "cudnn_batch_norm_backward", "miopen_batch_norm_backward")


def multi_tensor_kernels(lists: list, in_place: bool) -> int:
    """The launches of one multi-tensor op over ``lists`` (parallel tensor lists; one more, its outputs, unless
    ``in_place``): one per chunk of tensors or of blocks, by ATen's limits."""
    if not lists:
        return 1
    depth = min(len(lists) + (0 if in_place else 1), len(FOREACH_MAX_TENSORS))
    chunks = sum(-(-t.numel() // FOREACH_CHUNK) for t in lists[0])
    return max(1, -(-len(lists[0]) // FOREACH_MAX_TENSORS[depth - 1]), -(-chunks // FOREACH_MAX_BLOCKS))


def kernel_count(name: str, args: tuple, outs: list) -> int:
    """The CUDA kernels an aten op launches: a foreach op one per chunk of its tensor lists; a convolution's
    backward one per gradient it makes (input, weight, bias: cuDNN runs each as its own kernel); others one."""
    if name.startswith(("_foreach_", "_fused_")):
        lists = [a for a in args if isinstance(a, list | tuple) and a and isinstance(a[0], torch.Tensor)]
        return multi_tensor_kernels(lists, in_place=name.endswith("_"))
    if name == "convolution_backward":
        return max(1, len(outs))
    return 1


def _is_view(func) -> bool:
    """A view, or an op that moves no data (its result aliases its input, or is allocated and left unwritten)."""
    return func._overloadpacket.__name__ in _NO_TRAFFIC or any(
        r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class StepCounter(TorchDispatchMode):
    """Records every op of one training step as an ``Op``, playing CUDA autocast to ``low`` (None: fp32).

    Entering it enters ``_Autocast`` too, which casts the forward's inputs; this mode, below autograd, records every
    aten op that results (the casts as "cast") in ``phase``, which the step sets: forward, backward, optimizer.
    """

    def __init__(self, low: torch.dtype | None, scaling_files: tuple[str, ...] = (), block_fp8=None):
        super().__init__()
        self.low, self.phase, self.ops, self.scaling_files = low, "forward", [], scaling_files
        self.block_fp8 = block_fp8  # (shape, shape) -> whether a GEMM runs in block-scaled fp8 (mxfp8)
        self._autocast = Autocast(self)
        self._fp8_source_itemsize = 4  # the element size of the tensor fp8 last took an amax of

    def __enter__(self):
        self._autocast.__enter__()
        return super().__enter__()

    def __exit__(self, exc_type, exc_val, exc_tb):
        super().__exit__(exc_type, exc_val, exc_tb)
        self._autocast.__exit__(exc_type, exc_val, exc_tb)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # the torch calls a meta kernel or torchao's float8 tensor makes are no model's: autocast stays out of them
        with torch._C.DisableTorchFunction():
            return self._record(func, args, kwargs or {})

    def _record(self, func, args: tuple, kwargs: dict):
        name = func._overloadpacket.__name__
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            # a value read on the host (Adafactor's ``.item()`` of a norm): a meta tensor holds none, and the count
            # needs none; the read is a copy of one element to the host
            self.ops.append(Op("host read (.item())", str(args[0].dtype).removeprefix("torch."), 0.0,
                               float(args[0].element_size()), self.phase))
            return 1.0
        try:
            out = func(*args, **kwargs)
        except Exception as err:
            raise cannot_count(f"op {func}", err) from None
        if _is_view(func):
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        moved = sum(_bytes(t) for t in tensors) + sum(_bytes(t) for t in outs)
        if name.startswith("_foreach_") and name.endswith("_") and not outs and args and isinstance(args[0], list):
            moved += sum(_bytes(t) for t in args[0])  # an in-place foreach op returns nothing: it writes its first list
        kernels = kernel_count(name, args, outs)
        if name == "convolution_backward":  # each gradient's kernel reads the output's gradient again
            moved += (kernels - 1) * _bytes(args[0])
        elif name in BATCH_NORM_BACKWARD:  # two passes: the reductions over (dy, x), then dx from them
            moved += _bytes(args[0]) + _bytes(args[1])
        counter = flop_registry.get(func._overloadpacket)
        flops = float(counter(*args, **kwargs, out_val=out)) if counter else 0.0
        if self.scaling_files and not flops and _called_from(self.scaling_files):
            moved = self._fused_float8_bytes(name, tensors, outs)
            if not moved:
                return out
            name = "fp8 scaling and cast"
        mats = [t for t in tensors if t.dim() == 2]
        if flops and self.block_fp8 and len(mats) >= 2 and self.block_fp8(tuple(mats[-2].shape), tuple(mats[-1].shape)):
            self._block_fp8_gemm(name, flops, tensors, mats[-2:], outs)
            return out
        floating = [t for t in tensors if t.is_floating_point()]
        fp8 = [d for d in map(_float8_data, floating) if d is not None]
        dtype = fp8[0].dtype if fp8 else floating[0].dtype if floating else (outs[0].dtype if outs else torch.float32)
        op_name = "cast" if name == "_to_copy" else name
        self.ops.append(Op(op_name, str(dtype).removeprefix("torch."), flops, float(moved), self.phase, kernels))
        return out

    def _block_fp8_gemm(self, name: str, flops: float, tensors: list, operands: list, outs: list) -> None:
        """A GEMM in block-scaled fp8 (MX): each operand cast first (read in its dtype, written as fp8 with one
        e8m0 scale per 32 values), then the GEMM reads those and writes its output in its own dtype."""
        block = 1 + 1 / 32  # an fp8 byte per value and a scale byte per block
        for t in operands:
            self.ops.append(Op("fp8 block cast", str(t.dtype).removeprefix("torch."), 0.0,
                               float(_bytes(t) + t.numel() * block), self.phase))
        rest = sum(_bytes(t) for t in tensors if not any(t is o for o in operands)) + sum(_bytes(t) for t in outs)
        self.ops.append(Op(name, "float8_e4m3fn", flops, float(sum(t.numel() for t in operands) * block + rest),
                           self.phase))

    def _fused_float8_bytes(self, name: str, tensors: list, outs: list) -> float:
        """fp8's scaling as torch.compile fuses it: an amax pass reads the tensor, the cast reads it again and
        writes fp8; the elementwise steps between (abs, the upcast, clamp, the scale's arithmetic) fuse into those
        two and move nothing. The cast is charged for reading the tensor the amax read, in its own dtype."""
        if name in ("amax", "max", "aminmax") and tensors:
            self._fp8_source_itemsize = tensors[0].element_size()
            return float(_bytes(tensors[0]))
        if outs and outs[0].dtype.itemsize == 1 and outs[0].is_floating_point():
            return float(outs[0].numel() * (self._fp8_source_itemsize + 1))
        return 0.0


def _called_from(files: tuple[str, ...]) -> bool:
    """Whether the op being dispatched was called from a rung's scaling and casting code (torchao's float8: amax,
    scale, saturated cast; its other ops, a bias add, are eager)."""
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return False
        if "torchao" in frame.f_code.co_filename and frame.f_code.co_filename.endswith(files):
            return True
        frame = frame.f_back
    return False


def count(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str,
          make_optimizer, recipe: str | None = None, ends: bool = False, fused: bool = False,
          clip: float = 0.0, grad_norm: bool = False, inference: bool = False, stepped: dict | None = None) -> list[Op]:
    """Every op of one training step of ``model`` on batch ``(x, y)`` under ``precision``, on meta tensors
    (``inference``: of one forward pass in eval mode without gradients, as an inference benchmark times it).

    ``model`` is prepared as the precision trains it (fp8: torchao converts its eligible Linear layers, whose
    GEMMs then run on float8 tensors) and moved to the meta device (pass a copy); ``make_optimizer(params)``
    builds the optimizer the training uses (one that runs on meta tensors: foreach); ``fused``: the GPU runs its
    fused kernel instead, counted as one multi-tensor pass over parameters, gradients and state. ``clip`` > 0
    clips the gradients' norm first, ``grad_norm`` takes it without clipping. One step first, so the optimizer's
    state exists (the counted step is a steady one). ``stepped``: a dict shared by the counts of one model in
    several precisions: a rung that counts the model as it is (no layer swapped) takes the model and optimizer a
    count before it stepped, rather than a copy of its own stepped again (the state a step leaves has the same
    tensors in every such precision; the ops a step runs on meta tensors are what the count costs).
    """
    from ampbench.precision import rung

    rung = rung(precision)
    block_fp8 = rung.converted_gemms(model, recipe, ends)
    shared = stepped is not None and not inference and rung.counts_model_as_is()
    reuse = shared and "model" in stepped  # a count before this one stepped the model: its state exists
    if reuse:
        model, opt = stepped["model"], stepped["optimizer"]
    else:
        model = rung.roofline_model(model, recipe, ends).to("meta")
    x, y = x.to("meta"), y.to("meta")
    low = getattr(torch, rung.autocast) if rung.autocast else None
    fuse = rung.scaling_files
    if inference:
        model.eval()
        with StepCounter(low, fuse, block_fp8) as counter, torch.no_grad():
            model(x)
        return counter.ops
    if not reuse:
        opt = make_optimizer([p for p in model.parameters() if p.requires_grad])  # a frozen one gets no state

    def step(counter: StepCounter):
        opt.zero_grad(set_to_none=True)
        counter.phase = "forward"
        loss = F.cross_entropy(model(x), y)
        counter.phase = "backward"
        loss.backward()
        counter.phase = "optimizer"
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if rung.grad_scaler:  # GradScaler's unscale_: read and write every gradient once
            counter.ops.append(Op("unscale (GradScaler)", "float32", 0.0, float(2 * sum(_bytes(g) for g in grads)),
                                  "optimizer"))
        if clip or grad_norm:  # the gradients' norm (and, clipping, their scaling), as clip_grad_norm_ runs on CUDA
            # (its foreach path), written out: its own call does not run on meta tensors
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
            if clip:
                torch._foreach_mul_(grads, torch.clamp(clip / (total + 1e-6), max=1.0))
        start = len(counter.ops)
        opt.step()
        if fused:
            counter.ops[start:] = [fused_step(opt)]

    if not reuse:
        with StepCounter(low, fuse, block_fp8) as first:  # the optimizer's state made; counted: a failure is named
            step(first)
        if shared:
            stepped.update(model=model, optimizer=opt)
    with StepCounter(low, fuse, block_fp8) as counter:
        step(counter)
    return counter.ops


def fused_step(opt: torch.optim.Optimizer) -> Op:
    """A fused optimizer's step as the GPU runs it: one multi-tensor pass that reads every parameter, gradient and
    state tensor once and writes the parameters and the state (torch's ``_fused_sgd_`` / ``_fused_adamw_``)."""
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    states = [[v for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.numel() == p.numel()]
              for p in params]
    p_bytes = sum(_bytes(p) for p in params)
    s_bytes = sum(_bytes(v) for s in states for v in s)
    lists = 2 + (len(states[0]) if states else 0)  # parameters, gradients, and each state tensor a parameter has
    kernels = multi_tensor_kernels([params] * lists, in_place=True)
    return Op("fused optimizer step", "float32", 0.0, float(2 * p_bytes + p_bytes + 2 * s_bytes), "optimizer",
              kernels)


def summarize_ops(ops: list[Op]) -> dict:
    """FLOPs and bytes of a step, total and by category, and the conv share of the FLOPs."""
    flops = sum(op.flops for op in ops)
    conv = sum(op.flops for op in ops if op.category == "conv")
    by_cat = {c: {"flops": sum(o.flops for o in ops if o.category == c),
                  "bytes": sum(o.bytes for o in ops if o.category == c)} for c in CATEGORIES}
    return {"flops": flops, "bytes": sum(op.bytes for op in ops), "conv_flop_share": conv / flops if flops else 0.0,
            "by_category": by_cat}


def for_config(cfg, make_optimizer, batch: int | None = None, precisions: tuple[str, ...] | None = None,
               inference: bool = False) -> dict:
    """Count one training step of params.yaml's model at ``batch`` (train.batch_size) for each precision, its
    optimizer built by ``make_optimizer(params, cfg.train)`` (one that runs on meta tensors: foreach or for_loop):
    ``{"ops": {precision: [Op]}, "summary": summarize_ops of fp32, "model": name, ...}``; ``inference``: one
    forward pass in eval mode instead."""
    import copy
    import time

    from ampbench import data, models, runplan
    from ampbench.precision import names, rung

    precisions = precisions or names()
    batch = batch or cfg.train.batch_size
    desc = data.describe(cfg.data)
    size = models.input_size(cfg.model, desc["image_size"])
    model = models.build_meta(cfg.model, num_classes=desc["num_classes"], image_size=size)  # no weights
    x = torch.empty(batch, 3, size, size, device="meta")
    y = torch.empty(batch, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    # the optimizer as a GPU runs it (train.optimizer_impl, auto resolved for CUDA: fused where it skips cleanly)
    stepped = {}  # the unconverting precisions count one copy, stepped once
    ops, same_step = {}, {}
    for p in precisions:
        r, fused = rung(p), runplan.optimizer_impl(cfg, "", p, "cuda") == "fused"
        # a precision that swaps no layer and autocasts, scales and fuses as one counted before runs its very ops
        # (tf32 as fp32: TF32 changes the rate the datasheet gives a GEMM, not an op)
        key = (r.autocast, r.grad_scaler, r.scaling_files, fused) if r.counts_model_as_is() else None
        if key in same_step:
            ops[p] = [replace(op) for op in ops[same_step[key]]]
            continue
        # a precision that will take the stepped copy reads nothing of its own: no copy made for it
        own = model if "model" in stepped and r.counts_model_as_is() and not inference else copy.deepcopy(model)
        ops[p] = count(own, x, y, p, lambda params: make_optimizer(params, cfg.train),
                       runplan.recipe(cfg, p), cfg.model.convert_ends, fused=fused, clip=cfg.train.clip_grad_norm,
                       grad_norm=cfg.train.log_grad_norm, inference=inference, stepped=stepped)
        if key is not None:
            same_step[key] = p
    return {"ops": ops, "summary": summarize_ops(ops[precisions[0]]), "model": models.name(cfg.model),
            "batch": batch, "input_size": size, "count_s": time.perf_counter() - t0}
