"""CUDA autocast, played on meta tensors for the op counter (``measure.opcount``).

Autocast does nothing to meta tensors, and CUDA autocast is off on a machine without CUDA, so the counter plays
CUDA autocast itself where autocast works: above autograd, before a composite op checks its arguments (``F.conv2d``
its bias's dtype) or splits into aten ops. A ``TorchFunctionMode`` sees the model's calls; in the forward pass one on
CUDA autocast's lower-precision list (``LOWER``, from ``ATen/autocast_mode.h``) gets its floating inputs cast to
fp16/bf16, one on its fp32 list (``FP32``) to fp32 (or its dtype argument set to fp32), each cast counted as an op of
its own (a parameter is cast once per step, as autocast's cache does). Autograd sees the casts: the backward reads
the low-precision tensors the forward saved and casts the gradients back, as on a GPU.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode, redispatch_function
from torch.utils._pytree import tree_map

from ampbench.errors import AnalysisError, first_line

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


def cannot_count(what: str, err: Exception) -> AnalysisError:
    """One line naming what failed on meta tensors and its error's first line, guessing at no single cause."""
    return AnalysisError(f"the roofline cannot count this model: {what} fails on meta tensors ({first_line(err)}); "
                         "the model may not take this input size, or needs data-dependent shapes or values")


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    """``F.scaled_dot_product_attention`` as a GPU runs it, one fused kernel (memory-efficient attention), where
    meta tensors would take the math path and count the attention matrix written and read several times."""
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, True, dropout_p,
                                                                   is_causal, scale=scale)[0]


class Autocast(TorchFunctionMode):
    """CUDA autocast to ``counter.low`` in ``counter``'s forward phase, played on the model's calls: a listed function
    gets its inputs cast (``counter`` records each cast; autograd saves them for the backward) and runs with this mode
    off; any other runs with it on, so the calls inside a Python composite (``F.multi_head_attention_forward``) are
    seen too. ``F.scaled_dot_product_attention`` runs as the fused kernel in every precision."""

    def __init__(self, counter):
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
            raise cannot_count(op, err) from None

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
