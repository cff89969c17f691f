"""Any torchvision model: the size it takes found and named, its training graph one tensor of logits, a dozen
families checked end to end by `ampbench check-model`, and two of them through a shrunk `dvc repro`
(benchmarks/zoo.py runs all of them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ampbench import config, models
from ampbench.config import ModelConfig
from ampbench.errors import ConfigError
from ampbench.sandbox import REPO_ROOT
from ampbench.train import conformance


@pytest.mark.parametrize(("arch", "side", "fix"), [
    ("vit_b_16", 32, (224, "needs 224x224 inputs (the data's 32): set model.input_size: 224")),
    ("maxvit_t", 32, (224, "needs 224x224 inputs (the data's 32): set model.input_size: 224")),
    ("alexnet", 32, (64, "takes inputs of at least 63x63 (the data's 32): set model.input_size: 64")),
    ("inception_v3", 32, (80, "takes inputs of at least 75x75 (the data's 32): set model.input_size: 80")),
    ("vit_b_16", 256, (224, "needs 224x224 inputs (the data's 256): set model.input_size: 224")),
    ("swin_t", 32, None), ("googlenet", 32, None), ("regnet_y_400mf", 32, None)])
def test_the_input_size_a_model_takes_is_found_on_meta_tensors(arch, side, fix):
    assert models.input_size_fix(ModelConfig(arch=f"tv:{arch}"), 10, side) == fix


def test_a_wrong_input_size_set_by_the_user_is_named_as_theirs():
    with pytest.raises(ConfigError, match=r"'tv:maxvit_t' needs 224x224 inputs \(model.input_size = 96\): set "):
        models.check(ModelConfig(arch="tv:maxvit_t", input_size=96), num_classes=10, image_size=96)


@pytest.mark.parametrize("arch", ["googlenet", "inception_v3"])
def test_models_with_auxiliary_heads_train_on_one_tensor_of_logits(arch):
    model = models.build(ModelConfig(arch=f"tv:{arch}", channels_last=False), num_classes=10, image_size=80,
                         device="cpu")
    out = model.train()(torch.randn(2, 3, 80, 80))
    assert torch.is_tensor(out) and out.shape == (2, 10)
    assert not any("aux" in name for name, _ in model.named_modules())  # built without the auxiliary heads


def test_a_model_that_reads_values_in_its_constructor_is_built_on_the_cpu_and_moved():
    with pytest.raises(NotImplementedError), torch.device("meta"):  # RegNet: not on the meta device directly
        models.build(ModelConfig(arch="tv:regnet_x_400mf"), num_classes=10, image_size=32, device="meta")
    model = models.build_meta(ModelConfig(arch="tv:regnet_x_400mf"), num_classes=10, image_size=32)
    assert all(p.is_meta for p in model.parameters()) and models.takes(model, 32, 10)


class _AnySideFrom64(torch.nn.Module):
    """Takes any side of 64 or more; says it was built for 224, as a ViT does."""

    image_size = 224

    def __init__(self, num_classes=10):
        super().__init__()
        self.fc = torch.nn.Linear(3, num_classes)

    def forward(self, x):
        if x.shape[-1] < 64:
            raise ValueError(f"too small: {x.shape[-1]}")
        return self.fc(x.mean((2, 3)))


class _ReadsValues(_AnySideFrom64):
    """Computes with values while it is built, as RegNet does: not buildable on the meta device."""

    def __init__(self, num_classes=10):
        super().__init__(num_classes)
        self.widths = torch.linspace(1, 2, 3).tolist()


class _Pair(_AnySideFrom64):
    def forward(self, x):
        return self.fc(x.mean((2, 3))), x


def test_the_least_side_is_found_even_when_the_model_names_a_larger_one(monkeypatch):
    monkeypatch.setattr(models, "_builder", lambda cfg: lambda n, side: _ReadsValues(n))
    model = models.build_meta(ModelConfig(factory="mine:build"), num_classes=10, image_size=32)  # CPU, then meta
    assert all(p.is_meta for p in model.parameters())
    assert models.input_size_fix(ModelConfig(factory="mine:build"), 10, 32, model) == (
        64, "takes inputs of at least 64x64 (the data's 32): set model.input_size: 64")


def test_check_model_fails_a_model_that_gives_no_logits_at_any_side(tiny_params, monkeypatch):
    monkeypatch.setattr(models, "_builder", lambda cfg: lambda n, side: _Pair(n))
    result = conformance.check_model(_cfg(tiny_params, "small_cnn"), precisions=("fp32",))
    rows = {r["check"]: r for r in result["rows"]}
    assert rows["input size"]["ok"] is False and "no input side tried gives logits" in rows["input size"]["detail"]
    assert rows["step fp32"]["ok"] is False and result["ok"] is False


def _cfg(tiny_params, arch):
    tiny_params["model"] = {"arch": arch}
    return config.from_dict(tiny_params)


# one model per family; 224-only models step in fp32 only (a CPU step at 224 costs seconds), three small models
# step in every precision the pipeline has (fp16 and fp8 emulated on the CPU)
FAMILIES = {"resnet18": ("fp32",), "regnet_x_400mf": ("fp32", "bf16", "fp16", "fp8"),
            "efficientnet_b0": ("fp32",), "mobilenet_v3_small": ("fp32", "tf32", "bf16", "fp16", "fp8"),
            "convnext_tiny": ("fp32",), "squeezenet1_1": ("fp32", "bf16", "fp16", "fp8"), "googlenet": ("fp32",),
            "inception_v3": ("fp32",), "vit_b_32": ("fp32",), "swin_t": ("fp32",), "maxvit_t": ("fp32",),
            "densenet121": ("fp32",)}


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_check_model_over_the_families(tiny_params, arch):
    # the converting rungs' conformance on the models stepped in every precision (at 224, each costs tens of seconds)
    result = conformance.check_model(_cfg(tiny_params, f"tv:{arch}"), precisions=FAMILIES[arch],
                                     rungs=len(FAMILIES[arch]) > 1)
    rows = {r["check"]: r for r in result["rows"]}
    needs = {"inception_v3": 80, "vit_b_32": 224, "maxvit_t": 224}.get(arch)
    assert rows["input size"]["ok"] is (needs is None) and result["input_size"] == (needs or 32)
    # the roofline counts every family (biased convolutions after biased convolutions included)
    assert rows["roofline"]["flops_per_image"] > 0, rows["roofline"]["detail"]
    ratios = rows["roofline"]["ratios"]["H100 SXM"]
    # a step whose kernel launches outlast its kernels (launch-bound) gains little from the precision: said so
    assert (ratios["fp16_vs_fp32"] > 1 and ratios["bf16_vs_tf32"] > 0.9) or {"fp16", "bf16"} <= set(
        ratios["launch_bound"]), rows["roofline"]["detail"]
    assert [r["ok"] for r in result["rows"] if r["check"].startswith("step ")] == [True] * len(FAMILIES[arch]), \
        result["rows"]
    assert result["ok"] is (needs is None)
    if arch == "mobilenet_v3_small":  # its 576 -> 1024 classifier layer converts; the 1024 -> 10 head does not
        assert rows["fp8 converts"]["layers"] == 1 and "emulated on a CPU" in rows["step fp16"]["detail"]
    if len(FAMILIES[arch]) == 1:
        assert rows["mxfp8 conformance"]["detail"] == "not checked: not asked for", rows["mxfp8 conformance"]
    if arch == "mobilenet_v3_small":
        assert rows["fp8 conformance"]["ok"] and rows["mxfp8 conformance"]["ok"], result["rows"]


def test_check_model_command_prints_the_table_and_exits_non_zero_on_a_failure(tmp_path, tiny_params, monkeypatch,
                                                                             capsys):
    import yaml

    from ampbench import cli
    tiny_params["model"]["input_size"] = 0  # the data's 32 px, too small for the model
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params))
    proc = subprocess.run([sys.executable, "-m", "ampbench.cli", "check-model", "tv:vit_b_32", "--no-step", "later",
                           "--json", str(tmp_path / "out.json")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "| input size | FAIL | needs 224x224 inputs (the data's 32): set model.input_size: 224 |" in proc.stdout
    assert "| step fp32 | - | not stepped: later |" in proc.stdout and "input size failed" in proc.stderr
    found = json.loads((tmp_path / "out.json").read_text())
    assert found["ok"] is False and found["input_size"] == 224
    monkeypatch.chdir(tmp_path)  # a name no torchvision model has: one line, exit 2 (run_cli, as above)
    monkeypatch.setattr(sys, "argv", ["ampbench", "check-model", "tv:resnet5000"])
    with pytest.raises(SystemExit) as bad:
        cli.main()
    said = capsys.readouterr().err
    assert bad.value.code == 2 and "no classification model 'resnet5000'" in said and said.count("\n") == 1, said


def test_check_model_passes_the_default_model(tmp_path, tiny_params, monkeypatch, capsys):
    import yaml

    from ampbench import cli
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ampbench", "check-model", "small_cnn", "--precisions", "fp32,bf16"])
    cli.main()  # no SystemExit: every check passed
    out = capsys.readouterr().out
    assert "| step fp32 | ok |" in out and "| step bf16 | ok |" in out and "| roofline | - |" in out


def test_the_zoo_benchmark_writes_its_table(tmp_path):
    out = tmp_path / "zoo"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "zoo.py"), "--models",
                           "squeezenet1_1,alexnet", "--max-params", "10e6", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md, rows = out.with_suffix(".md").read_text(), out.with_suffix(".csv").read_text().splitlines()
    assert rows[0].startswith("model,params_m,input_size,input_fix") and len(rows) == 3
    assert "| squeezenet1_1 | 0.7M | 32 |" in md and "alexnet (takes inputs of at least 63x63" in md
    assert "- fp32 step: 1 pass, 1 not stepped (alexnet)" in md and "57M parameters, over 10M" in md


@pytest.mark.slow
def test_a_model_of_the_table_trains_through_dvc_repro(tmp_path):
    """GoogLeNet (auxiliary heads, which stopped the pipeline) trains through a shrunk pipeline with every analysis
    made (the sweep and the LoggedModel: the small CNN's pipeline test and the zoo benchmark; SqueezeNet's biased
    convolutions, which stopped the roofline: test_check_model_over_the_families[squeezenet1_1]; a model that stops
    in env_check: test_models and test_the_input_size_...)."""
    out = tmp_path / "zoo_pipeline"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "zoo_pipeline.py"), "--models",
                           "tv:googlenet", "--out", str(out), "--set", "sweep.enabled=false",
                           "--set", "paired.enabled=false",
                           "--set", "mlflow.enabled=false", "--set", "variants={fp32: {precision: fp32}, "
                           "bf16: {precision: bf16}}"], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = out.with_suffix(".md").read_text()
    assert "| tv:googlenet | trained | every analysis made |" in md, md
