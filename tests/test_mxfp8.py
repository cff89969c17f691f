"""mxfp8 (torchao's MX training): the rung added as one module and one registry line. What it converts (also a
weight a parent multiplies by directly), its roofline on meta tensors with no MX op run, its gate, the micro-batch
rule (its shrunk `dvc repro` on vit_tiny, beside fp8: test_fp8)."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import yaml

from ampbench import config, models, precision
from ampbench.errors import ConfigError
from ampbench.measure import opcount, roofline
from ampbench.sandbox import REPO_ROOT

MX = precision.rung("mxfp8")


def _vit():
    return models.build_meta(config.ModelConfig(arch="vit_tiny"), num_classes=10, image_size=32)


def test_mxfp8_converts_every_linear_its_weight_reaches_and_counts_on_an_unconverted_model():
    found = MX.census(_vit(), None, 32)
    # 6 blocks x (mlp.0, mlp.3, out_proj): out_proj's weight is multiplied by in F.multi_head_attention_forward,
    # which MX's weight wrapper sees (fp8's Float8Linear is not called there: 12)
    assert found["converted"] == 18 and len(found["called"]) == 18 and found["rows_per_image"] == [65]
    assert found["recipe"] == "mxfp8_rceil" and found["widest"] == [192, 768] and 0.5 < found["flop_share"] < 0.9
    assert len(precision.rung("fp8").census(_vit(), None, 32)["called"]) == 12
    resnet = models.build_meta(config.ModelConfig(arch="resnet18"), num_classes=10, image_size=32)
    assert MX.census(resnet, None, 32)["called"] == []  # its 512 -> 10 head is no multiple of 32
    # the roofline: the same FLOPs as bf16, the converted layers' three GEMMs each in fp8 with their block casts
    x, y = torch.empty(64, 3, 32, 32), torch.zeros(64, dtype=torch.long)
    opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    ops = {p: opcount.count(copy.deepcopy(_vit()), x, y, p, opt) for p in ("fp32", "bf16", "mxfp8")}
    fp8 = [op for op in ops["mxfp8"] if op.dtype.startswith("float8")]
    assert len(fp8) == 18 * 3 and len([op for op in ops["mxfp8"] if op.name == "fp8 block cast"]) == 2 * 18 * 3
    assert sum(op.flops for op in ops["mxfp8"]) == sum(op.flops for op in ops["bf16"])
    b200 = roofline.table(ops, roofline.find_gpu("B200"), 64, launch_us=0)  # the kernels alone (CUDA graphs)
    assert b200["mxfp8"]["vs_fp32"] > 1 and b200["mxfp8"]["step_ms"] != b200["bf16"]["step_ms"]
    eager = roofline.table(ops, roofline.find_gpu("B200"), 64)["mxfp8"]  # 64 images: launched one by one, the
    assert eager["launch_bound"] and eager["kernels"] > len(fp8)  # block casts' launches outlast the B200's kernels
    for gpu in ("H100 SXM", "RTX 5090"):  # no MX column: Hopper has none, 12.x is not measured
        assert "na" in roofline.table(ops, roofline.find_gpu(gpu), 64)["mxfp8"]
    hp = opcount.count(copy.deepcopy(_vit()), x, y, "mxfp8", opt, "mxfp8_rceil_wgrad_with_hp")
    assert len([op for op in hp if op.dtype.startswith("float8")]) == 18 * 2  # the weight's gradient in bf16


def test_mxfp8_gate_recipes_and_micro_batch_rule():
    assert MX.unsupported({"name": "NVIDIA B200", "capability": "10.0"}) is None and MX.unsupported(None) is None
    assert "n/a on this GPU until they are" in MX.unsupported({"name": "NVIDIA GeForce RTX 5090", "capability": "12.0"})
    assert "need compute capability 10.x (B200)" in MX.unsupported({"name": "NVIDIA H100", "capability": "9.0"})
    MX.check("mx", "mxfp8_emulated_rceil", "cpu")
    with pytest.raises(ConfigError, match="cannot run on a CPU.*mxfp8_emulated_rceil"):
        MX.check("mx", "mxfp8_rceil", "cpu")
    with pytest.raises(ConfigError, match="'rowwise' is not a recipe of precision mxfp8; choose one of: mxfp8_rceil"):
        config.from_dict({"variants": {"mx": {"precision": "mxfp8", "recipe": "rowwise"}}})
    found = MX.census(_vit(), None, 32)
    assert MX.check_batches(found, {"train.batch_size": 32}, "cpu") == []
    with pytest.raises(ConfigError) as err:
        MX.check_batches(found, {"train.batch_size = 64 over variants.mx.accum_steps = 4": 16}, "cpu")
    assert "16 x 65 = 1040 rows" in str(err.value) and "a multiple of 32 images" in str(err.value)
    assert MX.check_batches({**found, "recipe": "mxfp8_rceil_wgrad_with_hp"}, {"train.batch_size": 16}, "cpu") == []
    with pytest.raises(ConfigError, match=r"'mxfp8_rceil' \(the default\) cannot run on a CPU"):
        MX.check("mx", None, "cpu")
    from ampbench import cli  # the CPU demo's ladder: every rung a CPU runs at its batch, not mxfp8
    assert [v["precision"] for v in cli.LADDER.values()] == ["fp32", "tf32", "fp16", "bf16", "fp8"]


def test_env_check_refuses_an_mxfp8_micro_batch_that_breaks_the_block_rule(tmp_path):
    params = {"device": "cpu", "data": {"source": "synthetic"}, "mlflow": {"enabled": False},
              "model": {"arch": "vit_tiny"}, "train": {"batch_size": 64}, "sweep": {"enabled": False},
              "variants": {"mx": {"precision": "mxfp8", "accum_steps": 4, "recipe": "mxfp8_emulated_rceil"}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    r = tmp_path / "reports"
    out = subprocess.run([sys.executable, str(REPO_ROOT / "stages" / "env_check.py"), "--env", str(r / "env.json"),
                          "--plans", str(r / "plans"), "--data-source", str(r / "ds.json"), "--model-source",
                          str(r / "ms.json"), "--roofline", str(r / "rl.json")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "variants.mx.accum_steps = 4 gives mxfp8 micro-batches of 16 images" in out.stderr
    assert not r.exists()  # refused before anything is written


def _three_linears():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    with torch.no_grad():
        model[2].bias.fill_(100.0)
    return model


def test_mxfp8_keeps_the_bias_of_every_layer_it_converts_and_trains_it():
    """torchao's MX weight wrapper takes over F.linear and drops its bias; ampbench's adds it (the middle layer,
    converted, ends kept: a bias of 100 on its outputs)."""
    plain = _three_linears()
    mx = MX.prepare(copy.deepcopy(plain), "mxfp8_emulated_rceil")
    assert type(mx[2].weight) is not torch.nn.Parameter and type(mx[0].weight) is torch.nn.Parameter
    x = torch.randn(32, 64)
    with torch.no_grad():
        want, got = plain[:4](x), mx[:4](x)
    tol, _ = MX.tolerance(1)
    assert float((got - want).norm() / want.norm()) <= tol and got.mean() > 90  # torchao's alone: 0.01
    mx(x).sum().backward()
    assert all(p.grad is not None for p in mx.parameters())  # the bias trains


def test_mxfp8_casts_what_autocast_would_before_quantizing():
    """Under bf16 autocast every tensor MX quantizes is bf16, as MX's CUDA casts require (torchao's wrapper runs
    before autocast: a LayerNorm's fp32 output and the fp32 master weight reached it), and a Linear kept in high
    precision feeding a converted one runs (it stopped with "expected m1 and m2 to have the same dtype")."""
    model = MX.prepare(models.build(config.ModelConfig(arch="vit_tiny"), num_classes=10, image_size=16,
                                    device="cpu"), "mxfp8_emulated_rceil")
    x = torch.randn(32, 3, 16, 16)  # 32 x 17 tokens
    with MX.operand_spy() as seen:
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(x).float().sum()
        loss.backward()
    assert len(seen) >= 18 * 2 and set(seen) == {torch.bfloat16}, set(seen)
    mixed = MX.prepare(_three_linears(), "mxfp8_emulated_rceil")
    with torch.autocast("cpu", torch.bfloat16):
        assert mixed(torch.randn(32, 64)).dtype == torch.bfloat16


def test_check_model_checks_each_converting_rung_against_the_unconverted_model(monkeypatch):
    from ampbench.precision import mxfp8
    from ampbench.precision.linear import keeps
    from ampbench.train import conformance
    cfg = config.from_dict({"model": {"arch": "vit_tiny"}, "mlflow": {"enabled": False}})
    rows = {r["check"]: r for r in conformance.check_model(cfg, precisions=("fp32",))["rows"]}
    for name, layers in (("fp8", 12), ("mxfp8", 18)):
        row = rows[f"{name} conformance"]
        assert row["ok"] is True and row["layers"] == layers and row["error"] <= row["tolerance"], row
        assert f"2 x 2^-4 x sqrt({layers} layers)" in row["detail"]
        assert "every trainable parameter gets" in row["detail"]
    assert "casts to MX fp8 take bfloat16" in rows["mxfp8 conformance"]["detail"]

    def torchaos(model, recipe, ends=False):  # the conversion as torchao's quantize_ makes it
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_
        quantize_(model, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(recipe)),
                  filter_fn=keeps(model, mxfp8.eligible, ends))
        return model
    monkeypatch.setattr(mxfp8, "convert", torchaos)
    row = {r["check"]: r for r in conformance.check_model(cfg, precisions=("fp32",))["rows"]}["mxfp8 conformance"]
    assert row["ok"] is False and "get no gradient, e.g. encoder.layers.encoder_layer_0.mlp.0.bias" in row["detail"]
    assert "casts to MX fp8 take float32, and its CUDA kernels take bfloat16 only" in row["detail"], row["detail"]
