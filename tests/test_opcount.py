"""The op counter: FLOPs and bytes of an op by hand, CUDA autocast's lists, torchvision models in every precision,
an optimizer that reads a value on the host, a model it cannot count."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from ampbench import config
from ampbench.config import optim
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


@pytest.mark.parametrize("arch", ["squeezenet1_0", "regnet_y_400mf", "efficientnet_b0", "mobilenet_v3_small",
                                  "convnext_tiny"])
def test_torchvision_models_with_a_biased_conv_after_another_count_in_every_precision(arch):
    """Squeeze-and-excitation, Fire and ConvNeXt blocks feed one biased conv (or linear) the low-precision output of
    another: each model counts at 32x32, with the same FLOPs in every precision, every GEMM in its dtype."""
    model = torchvision.models.get_model(arch, weights=None, num_classes=10).to("meta")
    flops, stepped = set(), {}
    for precision, dtype in (("fp32", "float32"), ("tf32", "float32"), ("fp16", "float16"), ("bf16", "bfloat16")):
        ops = opcount.count(copy.deepcopy(model), torch.empty(4, 3, 32, 32), torch.zeros(4, dtype=torch.long),
                             precision, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), stepped=stepped)
        flops.add(sum(o.flops for o in ops))
        assert {o.dtype for o in ops if o.flops} == {dtype}
    assert len(flops) == 1


def test_precisions_that_count_the_model_as_it_is_share_one_stepped_copy_and_count_what_their_own_would():
    """for_config counts every precision of one model: those that swap no layer count one copy of it, stepped once
    (its optimizer's state made), each counted step the very ops a count of its own copy gives; fp8 and mxfp8,
    which convert the model, count their own."""
    from ampbench.precision import rung
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 32),
                          nn.ReLU(), nn.Linear(32, 16))
    train = config.from_dict({"train": {"optimizer": "adamw", "lr": 0.001}}).train
    x, y = torch.empty(16, 3, 8, 8), torch.zeros(16, dtype=torch.long)
    stepped = {}
    for precision in ("fp32", "fp16", "bf16", "tf32", "fp8", "mxfp8"):
        alone = opcount.count(copy.deepcopy(model), x, y, precision, lambda p: optim.for_count(p, train), clip=1.0)
        shared = opcount.count(copy.deepcopy(model), x, y, precision, lambda p: optim.for_count(p, train), clip=1.0,
                               stepped=stepped)
        assert shared == alone, precision
        assert any(o.name.startswith("_foreach") or "foreach" in o.name for o in shared if o.phase == "optimizer")
        assert rung(precision).counts_model_as_is() is (precision not in ("fp8", "mxfp8"))
    assert set(stepped) == {"model", "optimizer"} and stepped["optimizer"].state  # stepped once, then shared
    assert not any(o.name == "zeros_like" for o in opcount.count(copy.deepcopy(model), x, y, "fp16",
                                                                  lambda p: optim.for_count(p, train), stepped=stepped)
                   if o.phase == "optimizer")  # a steady step: no state made


def test_tf32_takes_fp32s_count_of_the_same_step_and_every_other_precision_is_counted(monkeypatch):
    """tf32 runs fp32's ops (TF32 changes the rate the datasheet gives a GEMM, not an op): for_config copies fp32's
    count instead of stepping the model again; every precision that autocasts, scales or converts is counted."""
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "small_cnn", "input_size": 16},
                            "train": {"batch_size": 8}})
    counted, real = [], opcount.count
    monkeypatch.setattr(opcount, "count", lambda model, x, y, precision, *a, **kw: counted.append(precision) or
                        real(model, x, y, precision, *a, **kw))
    found = opcount.for_config(cfg, optim.for_count, precisions=("fp32", "tf32", "fp16", "bf16", "fp8"))["ops"]
    assert counted == ["fp32", "fp16", "bf16", "fp8"]
    assert found["tf32"] == found["fp32"] and found["tf32"][0] is not found["fp32"][0]  # equal, not shared
    assert found["fp16"] != found["fp32"] and found["bf16"] != found["fp16"]


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


@pytest.mark.parametrize("name", ["sgd", "adamw", "adafactor"])
def test_every_registered_optimizer_is_counted_on_meta_tensors(name):
    """The optimizer step is counted as each registry entry runs it: Adafactor reads norms on the host
    (``.item()``), which a meta tensor cannot give; the counter reads 1.0 and counts the read."""
    train = config.from_dict({"train": {"optimizer": name}}).train
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 10))
    ops = opcount.count(model, torch.empty(4, 3, 4, 4), torch.zeros(4, dtype=torch.long), "fp32",
                        lambda params: optim.for_count(params, train))
    step = [o for o in ops if o.phase == "optimizer"]
    assert step and sum(o.bytes for o in step) >= 4 * (48 * 32 + 32 + 32 * 10 + 10) * 2  # every weight read, written
    reads = [o for o in step if o.name == "host read (.item())"]
    assert bool(reads) == (name == "adafactor")


def test_the_optimizer_clipping_and_the_backward_are_counted_as_the_gpu_runs_them():
    """On CUDA SGD and AdamW run fused (the registry's auto): one multi-tensor pass reading parameters, gradients and
    state once and writing parameters and state, not foreach's several; clipping adds the norm and the scaling, the
    logged norm the norm alone; a convolution's backward reads the output's gradient once per gradient it makes, and
    batch norm's backward makes two passes over its input and the output's gradient."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=True), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 10))
    x, y = torch.empty(4, 3, 8, 8), torch.zeros(4, dtype=torch.long)
    params = sum(p.numel() for p in model.parameters()) * 4

    def opt(p):
        return torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True)

    def optimizer_ops(**kw):
        return [op for op in opcount.count(copy.deepcopy(model), x, y, "fp32", opt, **kw) if op.phase == "optimizer"]

    fused = optimizer_ops(fused=True)
    assert [op.name for op in fused] == ["fused optimizer step"]
    assert fused[0].bytes == 5 * params and fused[0].kernels == 1  # p, g, momentum read; p, momentum written
    foreach = optimizer_ops()
    assert len(foreach) > 1 and sum(op.bytes for op in foreach) > fused[0].bytes
    clipped = {op.name for op in optimizer_ops(clip=1.0)}
    assert {"_foreach_norm", "_foreach_mul_"} <= clipped
    logged = {op.name for op in optimizer_ops(grad_norm=True)}
    assert "_foreach_norm" in logged and "_foreach_mul_" not in logged - {op.name for op in foreach}
    ops = opcount.count(copy.deepcopy(model), x, y, "fp32", opt)
    conv = next(op for op in ops if op.name == "convolution_backward")
    grad_out = 4 * 8 * 6 * 6 * 4
    inputs = (4 * 3 * 8 * 8 + 8 * 3 * 3 * 3) * 4  # the input and the weight
    written = (8 * 3 * 3 * 3 + 8) * 4  # the weight's and the bias's gradients (the input needs none)
    assert conv.kernels == 2 and conv.bytes == grad_out * 2 + inputs + written
    bn = next(op for op in ops if op.name == "native_batch_norm_backward")
    assert bn.bytes >= 2 * (grad_out + grad_out)  # dy and x, each read twice
    from ampbench.measure import roofline
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "small_cnn"}, "data": {"source": "synthetic"},
                            "train": {"batch_size": 8}})
    counted = roofline.for_config(cfg, optim.for_count, precisions=("fp32", "fp16"))
    assert [op.name for op in counted["ops"]["fp32"] if op.phase == "optimizer"] == ["fused optimizer step"]
    assert "unscale (GradScaler)" in [op.name for op in counted["ops"]["fp16"] if op.phase == "optimizer"]


def test_an_inference_count_is_one_forward_pass_in_eval_mode():
    """``inference``: the forward alone (no loss, backward or optimizer), batch norm with its running statistics,
    the same FLOPs as torch's counter on the forward, each weight cast once; what published inference figures
    are set beside."""
    from torch.utils.flop_counter import FlopCounterMode
    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5),
                          nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    x, y = torch.empty(4, 3, 8, 8), torch.zeros(4, dtype=torch.long)
    ops = opcount.count(copy.deepcopy(model), x, y, "fp16", None, inference=True)
    assert {op.phase for op in ops} == {"forward"} and not any("backward" in op.name for op in ops)
    assert not any("dropout" in op.name or "bernoulli" in op.name for op in ops)  # eval mode: dropout is identity
    bn = next(op for op in ops if op.name == "native_batch_norm")
    activation = 4 * 8 * 6 * 6 * 2  # fp16: read once and written once, beside a few vectors of 8 (its statistics)
    assert 2 * activation <= bn.bytes <= 2 * activation + 6 * 8 * 4  # eval mode: no batch statistics to take
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        copy.deepcopy(model).eval()(x)
    assert sum(op.flops for op in ops) == counter.get_total_flops()
    training = opcount.count(copy.deepcopy(model), x, y, "fp16", lambda p: torch.optim.SGD(p, lr=0.1))
    assert any("bernoulli" in op.name for op in training)  # the same model in training mode drops
    assert sum(op.flops for op in training) > 2 * sum(op.flops for op in ops)  # a backward (no input gradient)


def test_the_roofline_counts_what_autograd_runs_for_a_frozen_backbone():
    """A frozen ResNet-18 backbone: no weight-gradient GEMM for a frozen layer, no input gradient before the first
    trained one (the head: nothing but its own weight and bias gradients), and the optimizer reads and writes the
    head alone."""
    def counted(freeze):
        cfg = config.from_dict({"data": {"source": "synthetic"}, "model": {"arch": "resnet18", "freeze": freeze}})
        ops = opcount.for_config(cfg, optim.for_count, batch=8, precisions=("fp32",))["ops"]["fp32"]
        return {ph: (sum(o.flops for o in ops if o.phase == ph), sum(o.bytes for o in ops if o.phase == ph))
                for ph in ("forward", "backward", "optimizer")}
    full, frozen = counted([]), counted(["backbone"])
    assert frozen["forward"] == full["forward"]
    assert full["backward"][0] > 1.9 * full["forward"][0]  # input and weight gradients of every layer
    head = 2 * 8 * 512 * 10  # the head's weight-gradient GEMM, batch 8
    assert head <= frozen["backward"][0] < head + 8 * 10 * 8  # and the loss's gradient, elementwise
    params = 11_173_962
    assert frozen["optimizer"][1] / full["optimizer"][1] == pytest.approx((512 * 10 + 10) / params, rel=0.05)
