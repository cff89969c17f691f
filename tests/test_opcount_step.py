"""One training step counted whole: torchvision models in every precision, the precisions that share one counted
step, every registered optimizer (fused, clipping, the backward's reads), an inference pass, a frozen backbone."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

from ampbench import config
from ampbench.config import optim
from ampbench.measure import opcount


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
    stepped, made = {}, []

    def shared_optimizer(params):
        made.append(1)
        return optim.for_count(params, train)

    for precision in ("fp32", "fp16", "bf16", "tf32", "fp8", "mxfp8"):
        alone = opcount.count(copy.deepcopy(model), x, y, precision, lambda p: optim.for_count(p, train), clip=1.0)
        shared = opcount.count(copy.deepcopy(model), x, y, precision, shared_optimizer, clip=1.0, stepped=stepped)
        assert shared == alone, precision
        assert rung(precision).counts_model_as_is() is (precision not in ("fp8", "mxfp8"))
    # one optimizer (and model) for the four unconverting precisions, stepped once; fp8 and mxfp8 one each
    assert len(made) == 3 and stepped["optimizer"].state


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
