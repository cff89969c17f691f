"""The roofline: one training step's work op by op, and the least time a GPU's datasheet allows for it.

``count(model, x, y, precision, optimizer)`` runs one training step (forward, loss, backward, optimizer step) on
meta tensors, which hold shapes and dtypes but no data, so a ResNet-18 step at batch 256 costs milliseconds on
any CPU. A ``TorchDispatchMode`` sees every aten op below autograd and records its FLOPs (torch's own
``flop_counter`` formulas: convolutions, matmuls, attention) and the bytes it reads and writes (each tensor
argument and result once, views free).

Autocast does nothing to meta tensors, and CUDA autocast is off on a machine without CUDA, so the counter plays
CUDA autocast itself where autocast works: above autograd, before a composite op checks its arguments (``F.conv2d``
its bias's dtype) or splits into aten ops. A ``TorchFunctionMode`` sees the model's calls; in the forward pass one on
CUDA autocast's lower-precision list (``LOWER``, from ``ATen/autocast_mode.h``) gets its floating inputs cast to
fp16/bf16, one on its fp32 list (``FP32``) to fp32 (or its dtype argument set to fp32), each cast counted as an op of
its own (a parameter is cast once per step, as autocast's cache does). Autograd sees the casts: the backward reads
the low-precision tensors the forward saved and casts the gradients back, as on a GPU.
Attention is counted as the fused kernel a GPU runs (memory-efficient attention), not the math path meta tensors
would take. fp16 adds GradScaler's unscale pass over the gradients. fp8 converts the model as training does (torchao's
float8 Linear layers: their GEMMs run on float8 tensors), and its scaling is counted as ``torch.compile`` fuses it
(an amax pass and a cast pass per tensor; torchao's fp8 is only fast compiled), everything else as eager.

``step_time(ops, row, precision)``: each op takes max(FLOPs / the peak of the dtype it runs in, bytes /
memory bandwidth); their sum is the step's roofline time. Eager kernels, no fusion (``torch.compile`` fuses
elementwise ops and moves fewer bytes); every kernel at its datasheet peak, which real kernels do not reach.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, redispatch_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from ampbench.errors import AnalysisError, ConfigError, first_line
from ampbench.measure.flops import DATASHEET

# CUDA autocast's op lists (ATen/autocast_mode.h, AT_FORALL_LOWER_PRECISION_FP and AT_FORALL_FP32 /
# AT_FORALL_FP32_SET_OPT_DTYPE), as names; tests compare them with the installed torch's header.
LOWER = frozenset((
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention"))
# AT_FORALL_FP32_SET_OPT_DTYPE: autocast sets their dtype argument to fp32 (when the caller set none), so the op
# reads its low-precision input itself, with no cast of its own
_SET_OPT_DTYPE = frozenset(("prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
                            "linalg_matrix_norm", "sum"))
FP32 = frozenset((
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa")) | _SET_OPT_DTYPE
# Python-level names that are an op on the lists: an alias, or a composite whose insides autocast reaches and casts
# (cross_entropy's log_softmax and nll_loss run in fp32; linalg.norm takes a vector or matrix norm's fp32 dtype;
# nn.LSTM, GRU and RNN run cuDNN's RNN, which autocast casts to the low dtype as it does their cells)
_ALIASES = {"linalg_matmul": "matmul", "cross_entropy_loss": "nll_loss", "linalg_norm": "linalg_vector_norm",
            "lstm": "lstm_cell", "gru": "gru_cell", "rnn_tanh": "rnn_tanh_cell", "rnn_relu": "rnn_relu_cell"}

CATEGORIES = ("conv", "matmul", "attention", "memory-bound ops")


@dataclass
class Op:
    name: str          # the aten op, or "cast" / "unscale (GradScaler)"
    dtype: str         # the dtype its math runs in: float32, float16, bfloat16, float8
    flops: float
    bytes: float
    phase: str         # forward | backward | optimizer

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


def _is_view(func) -> bool:
    """A view, or an op that moves no data (its result aliases its input, or is allocated and left unwritten)."""
    return func._overloadpacket.__name__ in _NO_TRAFFIC or any(
        r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _autocast_op(func) -> str:
    """The op on CUDA autocast's lists a Python-level torch function is, or ''. Torch names a function as aten names
    its op (``F.conv2d``, ``torch.Tensor.softmax``, ``torch._C._nn.linear``; ``x @ w`` arrives as ``matmul``,
    ``torch.ops.aten.mm.default`` as ``mm.default``), or as an alias (``torch.special.softmax``)."""
    name = getattr(func, "__name__", "").split(".")[0]
    name = _ALIASES.get(name, name).removeprefix("special_")
    return name if name in LOWER or name in FP32 else ""


def _castable(t, dtype: torch.dtype) -> bool:
    """Whether autocast casts ``t`` to ``dtype``: a floating tensor in another dtype, not float64, nor a float8
    tensor (a subclass whose dtype names its original one)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_floating_point() \
        and t.dtype not in (dtype, torch.float64)


def _cannot_count(what: str, err: Exception) -> AnalysisError:
    """One line naming what failed on meta tensors and its error's first line, guessing at no single cause."""
    return AnalysisError(f"the roofline cannot count this model: {what} fails on meta tensors ({first_line(err)}); "
                         "the model may not take this input size, or needs data-dependent shapes or values")


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    """``F.scaled_dot_product_attention`` as a GPU runs it, one fused kernel (memory-efficient attention), where
    meta tensors would take the math path and count the attention matrix written and read several times."""
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, True, dropout_p,
                                                                   is_causal, scale=scale)[0]


class _Autocast(TorchFunctionMode):
    """CUDA autocast to ``counter.low`` in ``counter``'s forward phase, played on the model's calls: a listed function
    gets its inputs cast (``counter`` records each cast; autograd saves them for the backward) and runs with this mode
    off; any other runs with it on, so the calls inside a Python composite (``F.multi_head_attention_forward``) are
    seen too. ``F.scaled_dot_product_attention`` runs as the fused kernel in every precision."""

    def __init__(self, counter: StepCounter):
        super().__init__()
        self.counter = counter
        self._params: dict[tuple, tuple] = {}  # autocast's per-step cache: (parameter, dtype) -> (it, its cast)
        self._calling: list = []  # the functions running with this mode on, innermost last

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _autocast_op(func)
        if not op:
            # nothing is cast outside the forward, so the calls inside need not be seen; a Tensor method written in
            # Python that calls its C self (``super().unflatten``) comes back here as itself, and runs
            if self.counter.phase != "forward" or self._calling[-1:] == [func]:
                return func(*args, **kwargs)
            self._calling.append(func)
            try:
                with self:  # the calls inside a Python composite are seen too
                    return redispatch_function(func, types, args, kwargs)
            finally:
                self._calling.pop()
        if op == "scaled_dot_product_attention":
            func = _fused_attention
        if self.counter.phase == "forward" and self.counter.low is not None:
            args, kwargs = self._autocast(op, args, kwargs)
        try:
            return func(*args, **kwargs)  # with this mode off, as autocast runs a listed op with itself off
        except AnalysisError:
            raise
        except Exception as err:  # a composite's own check (a layer_norm's shape) fails before any aten op runs
            raise _cannot_count(op, err) from None

    def _autocast(self, op: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if op in LOWER:
            return tree_map(lambda t: self._cast(t, self.counter.low), (args, kwargs))
        if op not in _SET_OPT_DTYPE:
            return tree_map(lambda t: self._cast(t, torch.float32), (args, kwargs))
        first = args[0] if args else kwargs.get("input")
        given = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
        if _castable(first, torch.float32) and not given:
            kwargs = {**kwargs, "dtype": torch.float32}
        return args, kwargs

    def _cast(self, t, dtype: torch.dtype):
        """``t`` cast to ``dtype`` if autocast casts it. A parameter is cast once per step (autocast caches leaf
        tensors that require grad), an activation each time it is used."""
        if not _castable(t, dtype):
            return t
        if not (t.is_leaf and t.requires_grad):
            return t.to(dtype)
        key = (id(t), dtype)
        if key not in self._params:
            self._params[key] = (t, t.to(dtype))  # the parameter kept alive, so its id stays its own
        return self._params[key][1]


class StepCounter(TorchDispatchMode):
    """Records every op of one training step as an ``Op``, playing CUDA autocast to ``low`` (None: fp32).

    Entering it enters ``_Autocast`` too, which casts the forward's inputs; this mode, below autograd, records every
    aten op that results (the casts as "cast") in ``phase``, which the step sets: forward, backward, optimizer.
    """

    def __init__(self, low: torch.dtype | None, scaling_files: tuple[str, ...] = (), block_fp8=None):
        super().__init__()
        self.low, self.phase, self.ops, self.scaling_files = low, "forward", [], scaling_files
        self.block_fp8 = block_fp8  # (shape, shape) -> whether a GEMM runs in block-scaled fp8 (mxfp8)
        self._autocast = _Autocast(self)
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
        try:
            out = func(*args, **kwargs)
        except Exception as err:
            raise _cannot_count(f"op {func}", err) from None
        if _is_view(func):
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        moved = sum(_bytes(t) for t in tensors) + sum(_bytes(t) for t in outs)
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
        self.ops.append(Op(op_name, str(dtype).removeprefix("torch."), flops, float(moved), self.phase))
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
          make_optimizer, fp8_recipe: str | None = None) -> list[Op]:
    """Every op of one training step of ``model`` on batch ``(x, y)`` under ``precision``, on meta tensors.

    ``model`` is prepared as the precision trains it (fp8: torchao converts its eligible Linear layers, whose
    GEMMs then run on float8 tensors) and moved to the meta device (pass a copy); ``make_optimizer(params)``
    builds the optimizer the training uses. One step first, so the optimizer's state exists (the counted step is
    a steady one).
    """
    from ampbench.precision import spec

    rung = spec(precision)
    block_fp8 = rung.converted_gemms(model, fp8_recipe)
    model = rung.roofline_model(model, fp8_recipe).to("meta")
    x, y = x.to("meta"), y.to("meta")
    opt = make_optimizer(model.parameters())
    low = getattr(torch, rung.autocast) if rung.autocast else None

    def step(counter: StepCounter):
        opt.zero_grad(set_to_none=True)
        counter.phase = "forward"
        loss = F.cross_entropy(model(x), y)
        counter.phase = "backward"
        loss.backward()
        counter.phase = "optimizer"
        if rung.grad_scaler:  # GradScaler's unscale_: read and write every gradient once
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            counter.ops.append(Op("unscale (GradScaler)", "float32", 0.0, float(2 * sum(_bytes(g) for g in grads)),
                                  "optimizer"))
        opt.step()

    fuse = rung.scaling_files
    with StepCounter(low, fuse, block_fp8) as first:  # the optimizer's state made; counted too: a failure is named
        step(first)
    with StepCounter(low, fuse, block_fp8) as counter:
        step(counter)
    return counter.ops


# --- the datasheet side ------------------------------------------------------------------------------------

def gpu_names() -> list[str]:
    return [row["name"] for _, row in DATASHEET]


def find_gpu(name: str) -> dict:
    """The datasheet row of a GPU named as in the table (case and spaces ignored) or as torch names it, or a
    ConfigError with the close matches."""
    def norm(s: str) -> str:
        return "".join(s.lower().split())
    rows = {norm(row["name"]): row for _, row in DATASHEET}
    if norm(name) in rows:
        return rows[norm(name)]
    from ampbench.measure.flops import datasheet_row
    row = datasheet_row(name)  # as torch names the GPU: "NVIDIA A100-SXM4-80GB", or "A100" (the table's first match)
    if row:
        return row
    close = difflib.get_close_matches(name, gpu_names(), n=4, cutoff=0.3) or \
        [n for n in gpu_names() if norm(name)[:3] in norm(n)]
    hint = f"close: {', '.join(close)}" if close else f"the table has: {', '.join(gpu_names())}"
    raise ConfigError(f"--gpu {name!r} is not in the datasheet table; {hint} (or --gpu all)")


def _rate(op: Op, precision: str, row: dict) -> float | None:
    """The peak (FLOP/s) an op's math runs at on ``row``'s GPU; None when that GPU cannot run its dtype."""
    from ampbench.precision import spec
    column = spec(precision).peak_column(op.dtype, row)
    peak = row.get(column) if column else None
    return peak * 1e12 if peak else None


def step_time(ops: list[Op], row: dict, precision: str) -> dict | None:
    """The roofline step time of ``ops`` on ``row``'s GPU, with its memory-bound share and its time by
    category; None when the GPU has no rate for a dtype the step runs in (bf16 before Ampere)."""
    bandwidth = row["bandwidth_gbps"] * 1e9
    total = memory_bound = 0.0
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    for op in ops:
        mem_s = op.bytes / bandwidth
        if op.flops:
            rate = _rate(op, precision, row)
            if rate is None:
                return None
            compute_s = op.flops / rate
        else:
            compute_s = 0.0
        t = max(compute_s, mem_s)
        total += t
        by_category[op.category] += t
        if mem_s >= compute_s:
            memory_bound += t
    return {"step_s": total, "memory_bound_share": memory_bound / total if total else 0.0,
            "by_category_s": by_category}


def summarize_ops(ops: list[Op]) -> dict:
    """FLOPs and bytes of a step, total and by category, and the conv share of the FLOPs."""
    flops = sum(op.flops for op in ops)
    conv = sum(op.flops for op in ops if op.category == "conv")
    by_cat = {c: {"flops": sum(o.flops for o in ops if o.category == c),
                  "bytes": sum(o.bytes for o in ops if o.category == c)} for c in CATEGORIES}
    return {"flops": flops, "bytes": sum(op.bytes for op in ops), "conv_flop_share": conv / flops if flops else 0.0,
            "by_category": by_cat}


def table(counted: dict[str, list[Op]], row: dict, batch: int) -> dict[str, dict]:
    """Per precision on one GPU: roofline step time, img/s, the ratio to strict fp32 and to tf32."""
    from ampbench.precision import spec
    out = {}
    for precision, ops in counted.items():
        # a GPU without fp8 tensor cores cannot run the fp8 precision at all, even for a model it converts nothing of
        t = step_time(ops, row, precision) if spec(precision).runs_on(row) else None
        out[precision] = {"step_ms": t["step_s"] * 1e3, "imgs_per_s": batch / t["step_s"],
                          "memory_bound_share": t["memory_bound_share"]} if t else None
    for ref in ("fp32", "tf32"):
        base = out.get(ref)
        for r in out.values():
            if r is not None:
                r[f"vs_{ref}"] = base["step_ms"] / r["step_ms"] if base else None
    return out


def for_config(cfg, batch: int | None = None, precisions: tuple[str, ...] | None = None) -> dict:
    """Count one training step of params.yaml's model and optimizer at ``batch`` (train.batch_size) for each
    precision: ``{"ops": {precision: [Op]}, "summary": summarize_ops of fp32, "model": name, ...}``."""
    import copy
    import time

    from ampbench import data, models, runplan
    from ampbench.precision import names
    from ampbench.train.setup import optimizer

    precisions = precisions or names()
    batch = batch or cfg.train.batch_size
    desc = data.describe(cfg.data)
    size = models.input_size(cfg.model, desc["image_size"])
    model = models.build_meta(cfg.model, num_classes=desc["num_classes"], image_size=size)  # no weights
    plan = runplan.for_precision(cfg, "fp32", "cpu")
    x = torch.empty(batch, 3, size, size, device="meta")
    y = torch.empty(batch, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    ops = {p: count(copy.deepcopy(model), x, y, p, lambda params: optimizer(plan, params, "foreach"),
                    runplan.recipe(cfg, p)) for p in precisions}
    return {"ops": ops, "summary": summarize_ops(ops[precisions[0]]), "model": models.name(cfg.model),
            "batch": batch, "input_size": size, "count_s": time.perf_counter() - t0}


def closest_default(conv_flop_share: float) -> str:
    """Which rung a plain PyTorch run of this model is closest to: TF32 convolutions, IEEE fp32 matmuls."""
    return "tf32" if conv_flop_share >= 0.5 else "fp32"


ARTICLE_GPU = "RTX 5090"  # the article's card; its model, ResNet-18 (CIFAR stem), at its batch of 256


def record(cfg, gpu_name: str | None) -> dict:
    """What env_check writes as roofline.json for the report: the model's step counted per precision (fp8 only
    when a variant trains in it), its table on this GPU (when the datasheet has it), and the article's ResNet-18
    at batch 256 on an RTX 5090."""
    from ampbench import config
    from ampbench.measure.flops import datasheet_row
    from ampbench.precision import names, spec

    used = {v.precision for v in cfg.variants.values()}
    found = for_config(cfg, precisions=tuple(p for p in names() if spec(p).always_counted or p in used))
    s = found["summary"]
    out = {"model": found["model"], "batch": found["batch"], "input_size": found["input_size"],
           "flops": s["flops"], "bytes": s["bytes"], "conv_flop_share": s["conv_flop_share"],
           "closest_default": closest_default(s["conv_flop_share"]), "gpu": None}
    row = datasheet_row(gpu_name)
    if row:
        out["gpu"] = {"name": row["name"], "source": row["source"], "bandwidth_gbps": row["bandwidth_gbps"],
                      "table": table(found["ops"], row, found["batch"])}
    article = config.from_dict({"model": {"arch": "resnet18"}, "data": {"source": "synthetic"},
                                "train": {"batch_size": 256}})
    same = (cfg.model.arch, cfg.model.factory, found["batch"], found["input_size"]) == ("resnet18", "", 256, 32)
    ops = found["ops"] if same else for_config(article, 256, ("fp32", "fp16"))["ops"]
    ratio = table({p: ops[p] for p in ("fp32", "fp16")}, find_gpu(ARTICLE_GPU), 256)["fp16"]["vs_fp32"]
    out["article"] = {"gpu": ARTICLE_GPU, "model": "resnet18", "batch": 256, "fp16_vs_fp32": ratio}
    return out


def record_cached(cfg, gpu_name: str | None, shape: dict, folder) -> dict:
    """``record``, kept in ``folder`` (None: no cache) under a key of everything it depends on: the model (a
    factory's source too), the data's classes and image size (``shape``), the train section, the precisions the
    variants train in and the fp8 recipe, the GPU's name, torch, and this counter's code. env_check runs on every
    `dvc repro`, and counting a model on every run costs seconds that give the same answer."""
    import hashlib
    import json
    from pathlib import Path

    from ampbench import config, models, runplan
    from ampbench.results import atomic_write, source_digest, source_files

    if folder is None:
        return record(cfg, gpu_name)
    here = Path(__file__).resolve()
    key = hashlib.sha256(json.dumps({
        "model": config.to_dict(cfg.model), "model_source": models.source_hash(cfg.model), "shape": shape,
        "train": config.to_dict(cfg.train), "precisions": sorted({v.precision for v in cfg.variants.values()}),
        "recipes": {p: runplan.recipe(cfg, p) for p in sorted({v.precision for v in cfg.variants.values()})},
        "gpu": gpu_name, "torch": torch.__version__,
        "code": source_digest(source_files(here) + [here])}, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = Path(folder) / f"roofline-{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    out = record(cfg, gpu_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(out, sort_keys=True))
    for old in sorted(path.parent.glob("roofline-*.json"), key=lambda p: p.stat().st_mtime)[:-8]:
        old.unlink(missing_ok=True)  # the last 8 counts are kept
    return out
