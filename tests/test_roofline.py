"""The roofline counter: FLOPs and bytes of an op by hand, CUDA autocast's lists, the datasheet side, the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ampbench import config, models
from ampbench.errors import ConfigError
from ampbench.measure import roofline


def _forward_ops(low, fn, *tensors):
    tensors = [t.to("meta") for t in tensors]
    with roofline.StepCounter(low) as counter:
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


def test_a_linear_on_a_transposed_3d_input_stays_fp16_as_under_autocast():
    """F.linear on a non-contiguous 3-D input decomposes below autograd into bmm and a bias add: the add stays fp16
    (autocast casts linear as a whole), and the weight is cast once."""
    x, w, b = torch.empty(4, 8, 16), torch.empty(32, 16, requires_grad=True), torch.empty(32, requires_grad=True)
    x, w, b = x.to("meta"), w.detach().to("meta").requires_grad_(), b.detach().to("meta").requires_grad_()
    with roofline.StepCounter(torch.float16) as counter:
        out = F.linear(x.transpose(0, 1), w, b)
    assert out.dtype == torch.float16
    done = {(o.name, o.dtype) for o in counter.ops if o.name in ("mm", "add")}
    assert done == {("mm", "float16"), ("add", "float16")}


def test_backward_reads_the_forward_casts_and_attention_is_one_fused_op():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    ops = roofline.count(model, torch.empty(8, 64), torch.zeros(8, dtype=torch.long), "fp16",
                         lambda p: torch.optim.SGD(p, lr=0.1))
    backward_casts = [o for o in ops if o.name == "cast" and o.phase == "backward"]
    assert backward_casts and all(o.dtype == "float16" for o in backward_casts)  # only gradients back to fp32
    params = sum(p.numel() for p in model.parameters())
    # every parameter and the input once to fp16, the logits once back to fp32 for the loss
    assert sum(o.bytes for o in ops if o.name == "cast" and o.phase == "forward") == 6 * (params + 8 * 64 + 8 * 16)
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True)

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha, self.head = mha, torch.nn.Linear(64, 10)

        def forward(self, x):
            x = x.flatten(2).transpose(1, 2).repeat(1, 1, 16)  # 4 tokens of width 64
            return self.head(self.mha(x, x, x, need_weights=False)[0].mean(1))
    ops = roofline.count(Attn(), torch.empty(2, 4, 2, 2), torch.zeros(2, dtype=torch.long), "bf16",
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


def test_the_op_lists_are_cuda_autocasts_own():
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.is_file():
        pytest.skip(f"{header} is not in this torch install")
    text = header.read_text()

    def block(macro):
        body = text.split(f"#define {macro}(_)", 1)[1].split("\n\n", 1)[0]
        return set(re.findall(r"_\((\w+)", body))
    assert block("AT_FORALL_LOWER_PRECISION_FP") == set(roofline.LOWER)
    assert block("AT_FORALL_FP32") | block("AT_FORALL_FP32_SET_OPT_DTYPE") == set(roofline.FP32)


@pytest.fixture(scope="module")
def resnet18_counted():
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "resnet18"}, "data": {"source": "synthetic"}})
    return roofline.for_config(cfg, batch=256)


def test_resnet18_on_an_rtx_5090_gains_about_2x_from_fp16(resnet18_counted):
    """GeForce cards run fp16 with fp32 accumulation at twice their fp32 rate, and fp16 halves the bytes: the
    roofline ratio is near 2, far below the article's 3.2x."""
    found = resnet18_counted
    assert found["summary"]["flops"] == pytest.approx(3 * 256 * 1.11e9, rel=0.02)  # ~0.56 GMAC forward per image
    assert found["summary"]["conv_flop_share"] > 0.99 and roofline.closest_default(0.99) == "tf32"
    table = roofline.table(found["ops"], roofline.find_gpu("RTX 5090"), 256)
    assert 1.8 <= table["fp16"]["vs_fp32"] <= 2.05
    assert table["tf32"]["vs_fp32"] == pytest.approx(1.0)  # a GeForce card's TF32 rate is its fp32 rate
    h100 = roofline.table(found["ops"], roofline.find_gpu("H100 SXM"), 256)
    assert h100["tf32"]["vs_fp32"] > 3 and 1.5 < h100["fp16"]["vs_tf32"] < 2.1
    assert roofline.table(found["ops"], roofline.find_gpu("V100"), 256)["bf16"] is None  # no bf16 tensor cores
    cast_bytes = sum(o.bytes for o in found["ops"]["fp16"] if o.name == "cast" and o.phase == "forward")
    params = sum(p.numel() for p in models.build(config.ModelConfig(), num_classes=10, image_size=32,
                                                 device="meta").parameters())
    assert cast_bytes >= 6 * params  # every weight cast to fp16 once per step
    assert any(o.name == "unscale (GradScaler)" for o in found["ops"]["fp16"])
    assert not any(o.name == "unscale (GradScaler)" for o in found["ops"]["bf16"])


def test_a_gpu_not_in_the_table_lists_the_close_matches():
    assert roofline.find_gpu("rtx  5090")["name"] == "RTX 5090"
    assert roofline.find_gpu("NVIDIA A100-SXM4-80GB")["name"] == "A100 80GB SXM"  # torch's name for it
    with pytest.raises(ConfigError, match="'RTX 5080' is not in the datasheet table; close: RTX 5090"):
        roofline.find_gpu("RTX 5080")


def test_a_model_that_cannot_be_counted_names_the_op():
    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(12, 10)

        def forward(self, x):
            x = x.flatten(1)[:, :12]
            return self.fc(x[x.sum(1) > 0])  # boolean indexing: its shape depends on the values
    with pytest.raises(ConfigError, match="op aten.index.Tensor fails on meta tensors"):
        roofline.count(DataDependent(), torch.empty(4, 3, 2, 2), torch.zeros(4, dtype=torch.long), "fp32",
                       lambda p: torch.optim.SGD(p, lr=0.1))


def test_roofline_command_prints_every_gpu_and_refuses_a_bad_name(tmp_path):
    (tmp_path / "params.yaml").write_text("device: cpu\ndata: {source: synthetic}\nmodel: {arch: small_cnn}\n")
    run = [sys.executable, "-m", "ampbench.cli", "roofline", "--params", str(tmp_path / "params.yaml")]
    out = subprocess.run(run + ["--gpu", "all"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "| RTX 5090 |" in out.stdout and "| H100 SXM |" in out.stdout and "What a roofline is" in out.stdout
    bad = subprocess.run(run + ["--gpu", "RTX 9999"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "close:" in bad.stderr
