"""The roofline's datasheet side: ResNet-18's ratios on the article's card and others, GPU names, the CLI, the
count kept per params."""

from __future__ import annotations

import re
import sys

import pytest

from ampbench import config, models
from ampbench.config import optim
from ampbench.errors import ConfigError
from ampbench.measure import roofline


@pytest.fixture(scope="module")
def resnet18_counted():
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "resnet18"}, "data": {"source": "synthetic"}})
    return roofline.for_config(cfg, optim.for_count, batch=256)


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
    v100 = roofline.table(found["ops"], roofline.find_gpu("V100"), 256)
    assert v100["bf16"] == {"na": "no bf16 tensor cores on V100"}
    # no cell borrowed from another column: V100's tf32 is not fp32's figures, and nothing is taken against it
    assert v100["tf32"]["na"].startswith("no TF32 on V100") and v100["fp16"]["vs_tf32"] is None
    assert v100["fp16"]["vs_fp32"] > 1
    b200 = roofline.table(found["ops"], roofline.find_gpu("B200"), 256)  # fp8 converts nothing in ResNet-18
    assert b200["fp8"] == {"na": "fp8 converts no layer of this model: it would run bf16"} and "vs_fp32" in b200["bf16"]
    cast_bytes = sum(o.bytes for o in found["ops"]["fp16"] if o.name == "cast" and o.phase == "forward")
    params = sum(p.numel() for p in models.build(config.ModelConfig(), num_classes=10, image_size=32,
                                                 device="meta").parameters())
    assert cast_bytes >= 6 * params  # every weight cast to fp16 once per step
    assert any(o.name == "unscale (GradScaler)" for o in found["ops"]["fp16"])
    assert not any(o.name == "unscale (GradScaler)" for o in found["ops"]["bf16"])


def test_a_gpu_name_finds_its_own_row_and_no_namesakes():
    """A laptop part (a third of the compute), a China-market D part and a Grace Hopper superchip's GPU are not
    their namesakes: their own row where the table has one, else none, so no figures from another card; the command
    refuses them with the table's cards, and names the cards left out for want of a source."""
    from ampbench import env
    from ampbench.measure.flops import datasheet_row
    assert roofline.find_gpu("rtx  5090")["name"] == "RTX 5090"
    assert "fp8 peak (419 TFLOP/s with FP32 accumulation) is the whitepaper's alone" in \
        roofline.find_gpu("RTX 5090")["source"]  # a datasheet peak no measurement backs, marked so
    assert roofline.find_gpu("NVIDIA A100-SXM4-80GB")["name"] == "A100 80GB SXM"  # torch's name for it
    found = {n: (datasheet_row(n) or {}).get("name") for n in (
        "NVIDIA GeForce RTX 5090", "NVIDIA GeForce RTX 4090", "NVIDIA H200", "NVIDIA H100 80GB HBM3",
        "NVIDIA H100 PCIe", "Tesla V100-SXM2-16GB", "Tesla V100-PCIE-16GB", "NVIDIA GeForce RTX 3090",
        "Tesla V100S-PCIE-32GB", "NVIDIA GH200 480GB", "NVIDIA GH200 144G HBM3e", "NVIDIA RTX A6000",
        "NVIDIA RTX 6000 Ada Generation", "NVIDIA GeForce RTX 4090 Laptop GPU",
        "NVIDIA RTX PRO 6000 Blackwell Workstation Edition")}
    assert list(found.values()) == ["RTX 5090", "RTX 4090", "H200", "H100 SXM", "H100 PCIe", "V100", "V100 PCIe",
                                    "RTX 3090", "V100S PCIe", "GH200 96GB HBM3", "GH200 144GB HBM3e", "RTX A6000",
                                    "RTX 6000 Ada", "RTX 4090 Laptop", "RTX PRO 6000 Blackwell"]  # never a namesake's
    pro = datasheet_row("NVIDIA RTX PRO 6000 Blackwell Workstation Edition")
    assert (pro["fp16"], pro["bandwidth_gbps"]) == (503.8, 1792)  # a workstation part: full-rate FP32 accumulation
    with pytest.raises(ConfigError, match=r"left out for want of a source: RTX PRO 6000 Blackwell Max-Q and Server"):
        roofline.find_gpu("RTX PRO 6000 Blackwell Server Edition")
    assert [datasheet_row(n)["bandwidth_gbps"] for n in ("NVIDIA GH200 480GB", "NVIDIA GH200 144G HBM3e",
                                                           "NVIDIA B200", "Tesla V100S-PCIE-32GB")] == [
        4000, 4900, 7700, 1134]  # each part's own memory, not its namesake's
    for part in ("NVIDIA GeForce RTX 5090 Laptop GPU", "NVIDIA GeForce RTX 4080 Laptop GPU",
                 "NVIDIA GeForce RTX 4090 D", "NVIDIA GeForce RTX 5090 D", "NVIDIA GB200", "NVIDIA GH200 624GB",
                 "NVIDIA GeForce RTX 3090 Ti", "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
                 "NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA L40",
                 "NVIDIA A10G", "NVIDIA RTX A5000", "Quadro RTX 6000", "NVIDIA RTX 5000 Ada Generation"):
        assert datasheet_row(part) is None, part
        with pytest.raises(ConfigError, match="is not in the datasheet table.*the table has: B200, GH200 144GB HBM3e"):
            roofline.find_gpu(part)
        warned = env.warnings_for({"gpu": {"name": part, "capability": "8.9", "tensor_cores": True}})
        assert any(f"{part} is not in the datasheet table" in w and "n/a" in w for w in warned)


def test_roofline_command_prints_every_gpu_and_refuses_a_bad_name(tmp_path, monkeypatch, capsys):
    from ampbench import cli
    (tmp_path / "params.yaml").write_text("device: cpu\ndata: {source: synthetic}\nmodel: {arch: small_cnn}\n")
    run = ["ampbench", "roofline", "--params", str(tmp_path / "params.yaml")]
    monkeypatch.setattr(sys, "argv", run + ["--gpu", "all"])
    cli.main()
    out = capsys.readouterr().out
    assert "| RTX 5090 |" in out and "| H100 SXM |" in out and "What a roofline is" in out
    monkeypatch.setattr(sys, "argv", run + ["--gpu", "RTX 9999"])
    with pytest.raises(SystemExit) as bad:  # run_cli's exit: one line, no traceback
        cli.main()
    said = capsys.readouterr().err
    assert bad.value.code == 2 and said.count("\n") == 1 and "the table has: B200" in said


def test_the_roofline_of_an_inference_pass_counts_the_forward_alone(tmp_path, monkeypatch, capsys):
    from ampbench import cli
    (tmp_path / "params.yaml").write_text("device: cpu\ndata: {source: synthetic}\nmodel: {arch: small_cnn}\n")
    args = ["ampbench", "roofline", "--params", str(tmp_path / "params.yaml"), "--gpu", "RTX 5090", "--batch", "64"]
    outs = []
    for extra in ([], ["--inference"]):
        monkeypatch.setattr(sys, "argv", args + extra)
        cli.main()
        outs.append(capsys.readouterr().out)
    train, infer = outs
    assert "one training step" in train and "optimizer and loss included" in train
    head = infer.split("What a roofline is")[0]
    assert "one inference pass (forward only, eval mode, no gradients)" in head and "optimizer" not in head
    assert "GB moved per pass" in infer and "one inference pass (forward only) counted op by op" in infer
    gflop = [float(re.search(r"([\d.,]+) GFLOP", t).group(1)) for t in (train, infer)]
    assert 2 < gflop[0] / gflop[1] < 3.1  # forward and backward against the forward alone


def test_env_check_counts_a_model_once_per_params_and_again_when_they_change(tmp_path, monkeypatch):
    """record_cached: the same params give the stored count without counting; a changed batch, model or GPU name
    counts again, the article's ResNet-18 once for all of them; without a folder nothing is stored."""
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "small_cnn"}, "data": {"source": "synthetic"},
                            "train": {"batch_size": 16}})
    shape = {"num_classes": 10, "image_size": 32}
    counts = []
    monkeypatch.setattr(roofline, "record", lambda c, g, make, article=None: counts.append((c.train.batch_size, g))
                        or {"batch": c.train.batch_size, "flops": 1.5e9, "gpu": g, "article": article})
    articles = []  # the count itself: tests above
    monkeypatch.setattr(roofline, "article_record", lambda make: articles.append(1) or {"fp16_vs_fp32": 2.5})
    first = roofline.record_cached(cfg, None, shape, tmp_path, optim.for_count)
    assert roofline.record_cached(cfg, None, shape, tmp_path, optim.for_count) == first and counts == [(16, None)]
    other = config.from_dict({**config.to_dict(cfg), "train": {**config.to_dict(cfg)["train"], "batch_size": 32}})
    assert roofline.record_cached(other, None, shape, tmp_path, optim.for_count)["batch"] == 32
    roofline.record_cached(cfg, "NVIDIA H100 80GB HBM3", shape, tmp_path, optim.for_count)
    roofline.record_cached(cfg, None, {**shape, "num_classes": 100}, tmp_path, optim.for_count)
    assert counts == [(16, None), (32, None), (16, "NVIDIA H100 80GB HBM3"), (16, None)]
    assert len(list(tmp_path.glob("roofline-*.json"))) == 4 and len(list(tmp_path.glob("article-*.json"))) == 1
    assert articles == [1] and first["article"] == {"fp16_vs_fp32": 2.5}
    roofline.record_cached(cfg, None, shape, None, optim.for_count)
    assert len(counts) == 5 and len(list(tmp_path.glob("roofline-*.json"))) == 4


def test_a_step_of_more_kernels_than_its_gpu_time_allows_is_launch_bound(resnet18_counted):
    """tv:shufflenet_v2_x0_5 at batch 256 on an H100 SXM: its kernels take 0.07 ms at the datasheet's peaks, but the
    host launches about 500 of them one by one, at LAUNCH_US each: the step is launch-bound, no faster than that.
    ResNet-18 (CIFAR) at batch 256 is not, on the same card."""
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "tv:shufflenet_v2_x0_5"},
                            "data": {"source": "synthetic"}})
    found = roofline.for_config(cfg, optim.for_count, batch=256, precisions=("fp32", "fp16"))
    h100 = roofline.table(found["ops"], roofline.find_gpu("H100 SXM"), 256)
    fp32 = h100["fp32"]
    assert fp32["launch_bound"] and fp32["kernels_ms"] < 0.2 and fp32["kernels"] > 300
    assert fp32["step_ms"] == pytest.approx(fp32["kernels"] * roofline.LAUNCH_US / 1000)  # the floor, not 0.07 ms
    assert fp32["imgs_per_s"] < 256 / (fp32["kernels"] * 3e-6)  # no step faster than its launches
    # under CUDA graphs (no launches from the host) the floor goes, and the kernels' time is the step again
    assert not roofline.table(found["ops"], roofline.find_gpu("H100 SXM"), 256, launch_us=0)["fp32"]["launch_bound"]
    assert not roofline.table(resnet18_counted["ops"], roofline.find_gpu("H100 SXM"), 256)["fp16"]["launch_bound"]


def test_kernels_are_counted_as_the_gpu_launches_them_and_in_place_writes_count():
    """A convolution's backward launches a kernel per gradient (input, weight, bias); a foreach op one per chunk of
    its tensor lists (110 tensors for one list, MultiTensorApply's limit); an in-place foreach op returns nothing but
    writes its first list."""
    import torch

    from ampbench.measure import opcount
    convs = [torch.empty(4, 4, 3, 3, device="meta") for _ in range(300)]
    assert opcount.kernel_count("_foreach_mul_", (convs, 0.5), []) == 3  # 300 tensors, one list: 110 a launch
    assert opcount.kernel_count("_foreach_add", (convs, convs), convs) == 7  # two lists in, one out: 48 a launch
    big = [torch.empty(2**20, device="meta") for _ in range(4)]  # 64 chunks of 64K elements
    assert opcount.kernel_count("_foreach_mul_", (big * 6, 0.5), []) == 2  # 384 chunks: 320 a launch
    assert opcount.kernel_count("convolution_backward", (), [torch.empty(1)] * 3) == 3
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10))
    ops = opcount.count(model, torch.empty(2, 3, 8, 8), torch.zeros(2, dtype=torch.long), "fp32",
                        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True))
    conv_bwd = [op for op in ops if op.name == "convolution_backward"]
    assert conv_bwd and conv_bwd[0].kernels >= 2  # the input is the data: the weight's and the bias's gradients
    params = sum(p.numel() * 4 for p in model.parameters())
    in_place = [op for op in ops if op.phase == "optimizer" and op.name.startswith("_foreach_")
                and op.name.endswith("_")]
    assert in_place and all(op.bytes >= params for op in in_place)  # read and written: at least its list once
    add = next(op for op in in_place if op.name == "_foreach_add_")
    assert add.bytes >= 3 * params  # the parameters read and written, the update read
