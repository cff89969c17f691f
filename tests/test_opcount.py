"""The op counter: FLOPs and bytes of an op by hand, CUDA autocast's lists and casts, a model it cannot count (one
training step counted whole: test_opcount_step)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampbench.errors import AnalysisError
from ampbench.measure import cuda_autocast, opcount


def _forward_ops(low, fn, *tensors):
    tensors = [t.to("meta") for t in tensors]
    with opcount.StepCounter(low) as counter:
        fn(*tensors)
    return counter.ops


def test_a_linear_is_counted_by_hand():
    x, w, b = torch.empty(8, 64), torch.empty(32, 64), torch.empty(32)
    (op,) = _forward_ops(None, F.linear, x, w, b)
    assert op.name == "addmm" and op.dtype == "float32" and op.category == "matmul"
    assert op.flops == 2 * 8 * 64 * 32
    assert op.bytes == 4 * (8 * 64 + 64 * 32 + 32 + 8 * 32)  # x, W (its transpose is a view), bias, out
    # under fp16 autocast, each input is cast once (4 bytes read, 2 written) and the matmul moves half as much
    ops = _forward_ops(torch.float16, F.linear, x, w, b)
    casts, (mm,) = [o for o in ops if o.name == "cast"], [o for o in ops if o.name == "addmm"]
    assert sum(o.bytes for o in casts) == 6 * (8 * 64 + 64 * 32 + 32) and mm.dtype == "float16"
    assert mm.flops == op.flops and mm.bytes == op.bytes / 2


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _casts(ops, phase="forward"):
    return [o.bytes for o in ops if o.name == "cast" and o.phase == phase]


LOW = [("fp16", "float16"), ("bf16", "bfloat16")]


@pytest.mark.parametrize(("precision", "low"), LOW)
def test_a_biased_conv_after_a_biased_conv_runs_in_the_low_dtype_each_weight_and_bias_cast_once(precision, low):
    """F.conv2d checks its bias's dtype against its input's before any aten op runs: autocast casts the bias with
    the input and weight, so the second conv takes its predecessor's low-precision output. conv2 runs twice and its
    weight and bias are cast once (autocast's per-step cache)."""
    class Convs(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            return self.conv2(self.conv2(self.conv1(x))).mean((2, 3))
    ops = opcount.count(Convs(), torch.empty(4, 3, 8, 8), torch.zeros(4, dtype=torch.long), precision, _sgd)
    convs = [o for o in ops if o.category == "conv"]
    assert [(o.phase, o.dtype) for o in convs] == [("forward", low)] * 3 + [("backward", low)] * 3
    # each cast reads 4 bytes and writes 2 an element: the input, conv1's weight and bias, conv2's weight and bias,
    # then the logits back up to fp32 for the loss (2 read, 4 written)
    assert _casts(ops) == [6 * n for n in (4 * 3 * 8 * 8, 8 * 3 * 3 * 3, 8, 8 * 8 * 3 * 3, 8, 4 * 8)]
    # autograd casts back: the parameters' gradients to fp32, the loss's gradient to the logits' low dtype
    assert sum(_casts(ops, "backward")) == 6 * (8 * 3 * 3 * 3 + 8 + 8 * 8 * 3 * 3 + 8 + 4 * 8)


@pytest.mark.parametrize(("precision", "low"), LOW)
def test_a_biased_linear_runs_whole_in_the_low_dtype_as_under_autocast(precision, low):
    """Autocast casts F.linear's input, weight and bias before the composite splits (a transposed 3-D input, as
    attention's projections get, becomes a copy, an ``mm`` and a bias ``add``): all three run in the low dtype."""
    class Proj(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 10)

        def forward(self, x):
            return self.head(self.fc(x.transpose(0, 1)).mean(0))
    ops = opcount.count(Proj(), torch.empty(4, 8, 16), torch.zeros(4, dtype=torch.long), precision, _sgd)
    ran = {(o.name, o.dtype) for o in ops if o.phase == "forward" and o.name != "cast"}
    assert ran == {("clone", low), ("mm", low), ("add", low), ("mean", low), ("addmm", low),
                   ("_log_softmax", "float32"), ("nll_loss_forward", "float32")}
    # the input, fc's weight and bias, head's weight and bias, the logits up to fp32; the copy is of the cast input
    assert _casts(ops) == [6 * n for n in (4 * 8 * 16, 16 * 16, 16, 10 * 16, 10, 4 * 10)]
    assert [o.bytes for o in ops if o.name == "clone"] == [2 * 2 * 4 * 8 * 16]


def test_backward_reads_the_forward_casts_and_attention_is_one_fused_op():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    ops = opcount.count(model, torch.empty(8, 64), torch.zeros(8, dtype=torch.long), "fp16",
                         lambda p: torch.optim.SGD(p, lr=0.1))
    params = sum(p.numel() for p in model.parameters())
    # every parameter and the input once to fp16, the logits once back to fp32 for the loss
    assert sum(_casts(ops)) == 6 * (params + 8 * 64 + 8 * 16)
    # autograd casts back what autocast cast: the parameters' gradients to fp32, the loss's gradient to fp16
    backward_casts = {d: sum(o.bytes for o in ops if o.name == "cast" and o.phase == "backward" and o.dtype == d)
                      for d in ("float16", "float32")}
    assert backward_casts == {"float16": 6 * params, "float32": 6 * 8 * 16}
    assert all(o.dtype == "float16" for o in ops if o.phase == "backward" and o.flops)  # they read the fp16 casts
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True)

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha, self.head = mha, torch.nn.Linear(64, 10)

        def forward(self, x):
            x = x.flatten(2).transpose(1, 2).repeat(1, 1, 16)  # 4 tokens of width 64
            return self.head(self.mha(x, x, x, need_weights=False)[0].mean(1))
    ops = opcount.count(Attn(), torch.empty(2, 4, 2, 2), torch.zeros(2, dtype=torch.long), "bf16",
                         lambda p: torch.optim.SGD(p, lr=0.1))
    attention = [o for o in ops if o.category == "attention"]
    assert [o.phase for o in attention] == ["forward", "backward"] and all(o.dtype == "bfloat16" for o in attention)


def test_a_conv2d_is_counted_by_hand():
    x, w = torch.empty(2, 3, 8, 8), torch.empty(4, 3, 3, 3)
    (op,) = _forward_ops(None, lambda a, b: F.conv2d(a, b, padding=1), x, w)
    assert op.category == "conv" and op.flops == 2 * (2 * 4 * 8 * 8) * (3 * 3 * 3)
    assert op.bytes == 4 * (2 * 3 * 8 * 8 + 4 * 3 * 3 * 3 + 2 * 4 * 8 * 8)


def test_softmax_runs_in_fp32_under_autocast_and_views_move_nothing():
    x = torch.empty(4, 16)
    ops = _forward_ops(torch.bfloat16, lambda t: torch.softmax(t.to(torch.bfloat16).view(16, 4), -1), x)
    assert [o.name for o in ops] == ["cast", "cast", "_softmax"]  # bf16 in, cast back up, softmax in fp32
    assert ops[-1].dtype == "float32"


def test_the_fp32_list_casts_to_fp32_and_sum_takes_fp32_as_its_dtype_as_under_autocast():
    """Each call on autocast's fp32 list, operators and losses among them, casts an fp16 activation each time;
    sum and the others with a dtype argument get it set to fp32 and read fp16 themselves (no cast), unless the
    caller set one; creation and view ops run as called."""
    h = torch.empty(4, 16, device="meta", dtype=torch.float16)
    y = torch.zeros(4, dtype=torch.long, device="meta")
    calls = [  # a call, the op of it that runs in fp32, how many casts of h it takes
        (lambda: F.layer_norm(h, (16,)), "native_layer_norm", 1),
        (lambda: F.group_norm(h.view(4, 4, 4), 2), "native_group_norm", 1),
        (lambda: h ** 2, "pow", 1), (lambda: 2 ** h, "pow", 1), (lambda: h.exp(), "exp", 1),
        (lambda: torch.special.logsumexp(h, 1), "logsumexp", 1), (lambda: F.mse_loss(h, h), "mse_loss", 2),
        (lambda: F.cross_entropy(h, y), "nll_loss_forward", 1),
        (lambda: F.softmax(h, -1), "_softmax", 1)]  # its dtype set to fp32, softmax makes the cast itself
    for call, name, casts in calls:
        with opcount.StepCounter(torch.float16) as counter:
            assert call().dtype == torch.float32
        assert [o.name for o in counter.ops].count("cast") == casts
        assert [o.dtype for o in counter.ops if o.name == name] == ["float32"]
    with opcount.StepCounter(torch.float16) as counter:
        assert h.sum().dtype == torch.float32 and torch.cumsum(h, 0).dtype == torch.float32
        assert h.sum(dtype=torch.float16).dtype == torch.float16  # the caller's dtype stands
        made = [torch.zeros(3, device="meta"), torch.empty_like(h), h.view(-1), h.t(), torch.arange(4.0, device="meta")]
    assert [t.dtype for t in made] == [torch.float32, torch.float16, torch.float16, torch.float16, torch.float32]
    assert [o.name for o in counter.ops] == ["sum", "cumsum", "sum", "zeros", "arange"]


def test_every_function_torch_has_for_a_listed_op_is_cast_where_it_is_called():
    """Torch names a Python-level function as aten names its op (F.conv2d, torch.Tensor.softmax, torch._C._nn.linear,
    torch.linalg.vector_norm; torch.special's have a prefix): autocast's policy finds each, and ``@`` and nn.LSTM."""
    found = {}
    for name in cuda_autocast.LOWER | cuda_autocast.FP32:
        for space in (torch, torch.Tensor, F, torch._C._nn, torch.linalg, torch.special):
            for attr in {name, name.removeprefix("linalg_")}:
                func = getattr(space, attr, None)
                if callable(func):
                    found[f"{space.__name__}.{attr}"] = (cuda_autocast._autocast_op(func), name)
    assert len(found) > 150 and {k: v for k, v in found.items() if v[0] != v[1]} == {}
    x, w, lstm = torch.empty(4, 16, device="meta"), torch.empty(16, 8, device="meta"), nn.LSTM(16, 8).to("meta")
    with opcount.StepCounter(torch.bfloat16):
        assert (x @ w).dtype == torch.bfloat16 and torch.einsum("ij,jk->ik", x, w).dtype == torch.bfloat16
        assert lstm(x[None])[0].dtype == torch.bfloat16  # cuDNN's RNN, which autocast casts as it does the cells


def test_the_op_lists_are_cuda_autocasts_own():
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.is_file():
        pytest.skip(f"{header} is not in this torch install")
    text = header.read_text()

    def block(macro):
        body = text.split(f"#define {macro}(_)", 1)[1].split("\n\n", 1)[0]
        return set(re.findall(r"_\((\w+)", body))
    assert block("AT_FORALL_LOWER_PRECISION_FP") == set(cuda_autocast.LOWER)
    assert block("AT_FORALL_FP32") | block("AT_FORALL_FP32_SET_OPT_DTYPE") == set(cuda_autocast.FP32)
    assert block("AT_FORALL_FP32_SET_OPT_DTYPE") == set(cuda_autocast._SET_OPT_DTYPE)


def test_a_model_that_cannot_be_counted_names_the_op_and_its_error():
    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(12, 10)

        def forward(self, x):
            x = x.flatten(1)[:, :12]
            return self.fc(x[x.sum(1) > 0])  # boolean indexing: its shape depends on the values
    with pytest.raises(AnalysisError, match="op aten.index.Tensor fails on meta tensors"):
        opcount.count(DataDependent(), torch.empty(4, 3, 2, 2), torch.zeros(4, dtype=torch.long), "fp32", _sgd)
    # an input size the model does not take: the op and its error, one line, no cause claimed
    fixed = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 30 * 30, 10))
    with pytest.raises(AnalysisError) as err:
        opcount.count(fixed, torch.empty(4, 3, 16, 16), torch.zeros(4, dtype=torch.long), "fp16", _sgd)
    assert "\n" not in str(err.value)
    assert re.search(r"op aten.addmm.default fails on meta tensors \(.*\[4, 1568\] X \[7200, 10\].*\); the model may "
                     r"not take this input size, or needs data-dependent shapes", str(err.value))
    # a composite's own check fails before any aten op runs
    class Einsum(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(48, 10))

        def forward(self, x):
            return torch.einsum("bi,ij->bj", x.flatten(1), self.w)
    with pytest.raises(AnalysisError, match=r"einsum fails on meta tensors \(RuntimeError: einsum\(\): subscript i "
                                            r"has size 48"):
        opcount.count(Einsum(), torch.empty(4, 3, 2, 2), torch.zeros(4, dtype=torch.long), "bf16", _sgd)
