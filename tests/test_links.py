"""The roofline for N GPUs (measure/links.py, `ampbench roofline --nproc N --strategy ddp|fsdp`): every GPU of the
datasheet table says its link or why it has none, the link is the one that joins that many GPUs, the bytes are
the collectives' (DDP's all-reduce, FSDP's all-gathers and reduce-scatter, by dtype), and their time bounds the
step when it is the longer."""

from __future__ import annotations

import re
import sys

import pytest

from ampbench import config
from ampbench.config import optim
from ampbench.errors import ConfigError
from ampbench.measure import links, roofline
from ampbench.measure.flops import DATASHEET


def test_every_gpu_of_the_table_says_its_link_or_why_none():
    names = [row["name"] for _, row in DATASHEET]
    assert set(links.LINKS) == set(names)  # a new row must say its link (or None, with a reason)
    for name, found in links.LINKS.items():
        if found:
            assert found["source"] and (found["pcie"] or found["nvlink_gbps"]), name
            assert not found["nvlink_gbps"] or found["nvlink_gpus"] >= 2, name


def test_the_link_is_the_one_that_joins_that_many_gpus():
    h100_pcie, sxm = roofline.find_gpu("H100 PCIe"), roofline.find_gpu("H100 SXM")
    assert links.link(h100_pcie, 2)["gbps"] == 600 and "bridge" in links.link(h100_pcie, 2)["name"]
    four = links.link(h100_pcie, 4)  # a bridge joins a pair: four cards ring over their slots
    assert four["gbps"] == 128 and four["name"].startswith("PCIe Gen5") and "joins 2 only" in four["name"]
    assert links.link(sxm, 8)["gbps"] == 900 and "NVSwitch" in links.link(sxm, 8)["name"]
    assert links.link(roofline.find_gpu("RTX 4090"), 4)["gbps"] == 64
    assert links.link(roofline.find_gpu("GH200 96GB HBM3"), 2) is None
    assert links.link(roofline.find_gpu("B200"), 8)["gbps"] == 1800
    a100 = roofline.find_gpu("A100 40GB")  # the row of the SXM4 board and the PCIe card: named SXM, NVSwitch's 8
    assert links.link(a100, 8)["gbps"] == 64 and links.link(a100, 8, "A100-SXM4-40GB")["gbps"] == 600
    with pytest.raises(ConfigError, match="a global batch of 4 over 8 GPUs leaves a GPU without an image"):
        links.share(4, 8)


@pytest.fixture(scope="module")
def counted():
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "resnet18"}, "data": {"source": "synthetic"},
                            "train": {"batch_size": 256}})
    found = roofline.for_config(cfg, optim.for_count, links.share(256, 8), ("fp32", "bf16", "fp16", "fp8"))
    model, state = links.model_counts(cfg, optim.for_count)
    return found, model, state


def test_the_collectives_bytes_and_time_are_the_ring_s(counted):
    found, model, state = counted
    assert state == 1 and found["batch"] == 32  # SGD's momentum; 256 over 8 GPUs
    trained = sum(q.numel() for q in model.parameters())
    row = roofline.find_gpu("H100 SXM")
    ddp = links.table(found["ops"], row, model, state, 8, "ddp", 256)
    fsdp = links.table(found["ops"], row, model, state, 8, "fsdp", 256)
    assert ddp["fp32"]["sent_bytes"] == int(2 * 7 / 8 * trained * 4)  # the ring all-reduce, fp32 gradients
    assert ddp["bf16"]["sent_bytes"] == ddp["fp32"]["sent_bytes"]  # DDP sends the fp32 gradients whatever autocasts
    assert ddp["fp32"]["comm_ms"] == pytest.approx(ddp["fp32"]["sent_bytes"] / 450e9 * 1e3)  # half of 900 GB/s
    # FSDP fp32: all-gathered twice (forward, backward), reduce-scattered once: 3 (N-1)/N of the fp32 parameters
    assert fsdp["fp32"]["sent_bytes"] == pytest.approx(3 * 7 / 8 * trained * 4, rel=1e-6)
    # bf16 gathers its blocks in bf16 (BatchNorm's and the root's own stay fp32): fewer bytes than fp32's gathers
    gather = fsdp["bf16"]["wire"]["all_gather"]
    assert set(gather["by_dtype"]) == {"float32", "bfloat16"} and gather["by_dtype"]["bfloat16"] > 0
    assert 0.5 < gather["bytes"] / fsdp["fp32"]["wire"]["all_gather"]["bytes"] < 0.55
    assert fsdp["fp8"]["na"].startswith("fp8")  # fp8 converts no layer of ResNet-18 (no Linear of 16s), so n/a
    # memory per GPU: DDP the whole model, its gradients, buckets and momentum; FSDP 1/8 of them and two blocks
    assert sum(ddp["fp32"]["memory_per_gpu"].values()) == 4 * trained * 4
    parts = fsdp["fp32"]["memory_per_gpu"]
    assert parts["parameters"] == parts["gradients"] == parts["optimizer_state"] == -(-trained * 4 // 8)
    assert sum(parts.values()) < sum(ddp["fp32"]["memory_per_gpu"].values()) / 2
    for t in (ddp, fsdp):  # the step: the longer of one GPU's kernels and the collectives on NVLink
        for p in ("fp32", "bf16"):
            r = t[p]
            assert r["step_ms"] == pytest.approx(max(r["gpu_step_ms"], r["comm_ms"]))
            assert r["imgs_per_s"] == pytest.approx(256 / r["step_ms"] * 1e3)


def test_a_slow_link_makes_the_collectives_bound_the_step(counted):
    found, model, state = counted
    # eight RTX 4090s over PCIe Gen4 (32 GB/s sent): fp32's kernels take longer than its all-reduce, bf16's do not,
    # so the collectives cap what bf16 buys over fp32 below one GPU's ratio
    t = links.table(found["ops"], roofline.find_gpu("RTX 4090"), model, state, 8, "ddp", 256)
    assert t["fp32"]["bound"] == "kernels" and t["bf16"]["bound"] == "collectives"
    bf16 = t["bf16"]
    assert bf16["step_ms"] == pytest.approx(bf16["comm_ms"]) and bf16["comm_ms"] > bf16["gpu_step_ms"]
    assert t["bf16"]["imgs_per_s"] / t["fp32"]["imgs_per_s"] < t["fp32"]["gpu_step_ms"] / t["bf16"]["gpu_step_ms"]
    # the link as the GPU was named times the table, as the header says it (an A100 40GB named SXM: NVSwitch)
    a100 = roofline.find_gpu("A100 40GB")
    sxm = links.table(found["ops"], a100, model, state, 8, "ddp", 256, found=links.link(a100, 8, "A100-SXM4-40GB"))
    assert sxm["fp32"]["comm_ms"] == pytest.approx(sxm["fp32"]["sent_bytes"] / 300e9 * 1e3)
    gh = links.table(found["ops"], roofline.find_gpu("GH200 96GB HBM3"), model, state, 2, "ddp", 256)
    assert gh["fp32"]["comm_ms"] is None and gh["fp32"]["imgs_per_s"] is None  # no link: bytes, no time


def test_the_command_prints_n_gpus_and_refuses_what_it_cannot_count(tmp_path, monkeypatch, capsys):
    from ampbench import cli
    (tmp_path / "params.yaml").write_text("device: cpu\ndata: {source: synthetic}\nmodel: {arch: small_cnn}\n"
                                          "train: {batch_size: 64}\n")
    run = ["ampbench", "roofline", "--params", str(tmp_path / "params.yaml"), "--gpu", "H100 SXM"]
    monkeypatch.setattr(sys, "argv", run + ["--nproc", "4", "--strategy", "fsdp"])
    cli.main()
    out = capsys.readouterr().out
    assert "on 4 H100 SXM GPUs (FSDP)" in out and "global batch 64 (16 per GPU)" in out
    assert "NVLink through NVSwitch, 900 GB/s per GPU both ways, so 450 GB/s" in out
    assert re.search(r"\| bf16 \| [\d.]+ ms \| all-gather [\d.]+ [KM]iB fp32\+bf16; reduce-scatter", out)
    assert "- bf16: parameters" in out and "gathered blocks" in out
    for bad, said in ((["--nproc", "9"], "--nproc 9: give 1 to 8 GPUs"),
                      (["--nproc", "2", "--inference"], "--inference with --nproc"),
                      (["--nproc", "2", "--gpu", "all"], "--gpu all with --nproc: name one GPU")):
        monkeypatch.setattr(sys, "argv", run + bad)
        with pytest.raises(SystemExit) as stop:
            cli.main()
        err = capsys.readouterr().err
        assert stop.value.code == 2 and said in err and err.count("\n") == 1, err
    with pytest.raises(ConfigError, match="--strategy 'zero'"):
        links.check(2, "zero")


def test_fp8_under_fsdp_counts_its_gathers_in_fp8_and_a_recipe_fsdp_refuses_is_n_a(tmp_path, monkeypatch, capsys):
    """A model whose blocks fp8 converts (test_fsdp's MLP): its converted weights counted gathered in one byte; with
    the rowwise recipe, which FSDP here refuses, the row says why (n/a), as `dvc repro` would refuse it."""
    from ampbench import cli
    run = ["ampbench", "roofline", "--params", str(tmp_path / "params.yaml"), "--gpu", "H100 SXM", "--nproc", "2",
           "--strategy", "fsdp"]
    for recipe in ("tensorwise", "rowwise"):
        (tmp_path / "params.yaml").write_text(
            "device: cpu\ndata: {source: synthetic}\nmodel: {factory: 'tests.test_fsdp:mlp'}\n"
            f"train: {{batch_size: 64}}\nvariants: {{f8: {{precision: fp8, recipe: {recipe}}}}}\n")
        monkeypatch.setattr(sys, "argv", run)
        cli.main()
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("| fp8 |"))
        if recipe == "tensorwise":
            assert re.search(r"all-gather [\d.]+ [KM]iB bf16\+float8; reduce-scatter", row), row
            assert "ampbench trains eager" not in out  # train.compile auto compiles fp8 under FSDP too
        else:
            assert "n/a: fp8 recipe 'rowwise' under FSDP: torchao all-gathers its weights in their own format" in row
