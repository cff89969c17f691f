"""fp8 (torchao float8 training): conversion, a training step on a CPU, what env_check says and refuses."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import yaml
from torch import nn

from ampbench import config, models, precision, runplan
from ampbench.errors import ConfigError, EnvironmentMismatch
from ampbench.sandbox import REPO_ROOT
from ampbench.train import setup
from ampbench.train.policy import PrecisionPolicy
from tests.conftest import verdict_of
from tests.test_env import CU130, _fake_gpu


def test_a_float8_training_step_runs_on_a_cpu_and_updates_the_converted_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))  # 64 -> 10: not a multiple of 16
    policy = PrecisionPolicy("fp8", "cpu", None, "tensorwise", convert_ends=True)
    model = policy.prepare(model)
    converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert converted == ["0"]
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    with policy.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and not policy.uses_scaler
    after = model.state_dict()
    assert not torch.equal(before["0.weight"], after["0.weight"]) and not torch.equal(before["2.weight"],
                                                                                       after["2.weight"])
    assert set(after) == set(before)  # a checkpoint of the converted model has the plain model's keys


def test_fp8_on_a_cpu_runs_scaled_mm_through_its_emulated_kernel_in_the_forward_and_backward(monkeypatch):
    """On a CPU with AMX-INT8 (a Sapphire Rapids Xeon) torch sends ``_scaled_mm`` to oneDNN's fp8 GEMM, the same
    numbers some 250 times slower than its emulated kernel: a step of the fp8 pipeline test took 90 s there. Every
    fp8 GEMM of a step, forward and backward, runs with oneDNN off, and only then: the step leaves it as it was."""
    from ampbench.train import step
    seen = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        seen.append(torch._C._get_mkldnn_enabled())
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    torch.manual_seed(0)
    policy = PrecisionPolicy("fp8", "cpu", None, "tensorwise", convert_ends=True)
    model = policy.prepare(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert torch._C._get_mkldnn_enabled()
    step.train_step(model, opt, policy.scaler(), policy, torch.randn(16, 32), torch.randint(0, 16, (16,)), 16)
    assert len(seen) == 6 and not any(seen)  # 2 layers x (output, input gradient, weight gradient)
    assert torch._C._get_mkldnn_enabled()  # the other rungs keep oneDNN
    with PrecisionPolicy("fp32", "cpu", None).autocast():
        assert torch._C._get_mkldnn_enabled()


def test_the_first_layer_and_the_classifier_head_stay_in_high_precision_unless_a_param_converts_them():
    """torchao advises against converting the output layer; ``model.convert_ends: true`` converts both ends."""
    def mlp():
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                             nn.Linear(64, 32))
    for rung in ("fp8", "mxfp8"):
        r = precision.rung(rung)
        recipe = r.cpu_recipes[0]
        assert r.census(mlp(), recipe, 4)["called"] == ["3"]  # 1 (first layer) and 5 (head) kept
        assert r.census(mlp(), recipe, 4, ends=True)["called"] == (["1", "3", "5"] if rung == "fp8" else ["3", "5"])
    fp8 = PrecisionPolicy("fp8", "cpu", None, "tensorwise")
    kept = [n for n, m in fp8.prepare(mlp()).named_modules() if type(m).__name__ == "Float8Linear"]
    assert kept == ["3"]
    cfg = config.from_dict({"model": {"convert_ends": True}, "variants": {"f": {"precision": "fp8"}}})
    plan = runplan.make_plan(cfg, "f", "cpu")
    s = setup.build(plan, {"num_classes": 32, "image_shape": [3, 4, 4]}, torch.device("cpu"))
    assert s.policy.convert_ends


def test_fp8_counts_the_layers_a_forward_calls_not_the_modules_it_converts():
    """torchvision's attention calls out_proj's weight directly: in vit_tiny only the MLP Linears run in fp8."""
    vit = models.build(config.ModelConfig(arch="vit_tiny"), num_classes=10, image_size=32, device="cpu")
    found = precision.rung("fp8").census(vit, "tensorwise", 32)
    assert found["converted"] == 18  # 6 blocks x (out_proj, mlp.0, mlp.3)
    assert len(found["called"]) == 12 and all(".mlp." in n for n in found["called"])
    assert found["widest"] == [192, 768] and 0.3 < found["flop_share"] < 0.9
    resnet = models.build(config.ModelConfig(arch="resnet18"), num_classes=10, image_size=32, device="cpu")
    assert precision.rung("fp8").census(resnet, "tensorwise", 32)["called"] == []  # its 512 -> 10 head does not qualify


def test_the_fp8_plan_carries_its_recipe_and_the_others_do_not_change(tmp_path):
    cfg = config.from_dict({"variants": {"fp32": {"precision": "fp32"},
                                         "fp8": {"precision": "fp8", "recipe": "rowwise"}}})
    fp8, fp32 = runplan.make_plan(cfg, "fp8", "cpu"), runplan.make_plan(cfg, "fp32", "cpu")
    assert fp8.recipe == "rowwise" and fp32.recipe is None
    runplan.write_plan(fp32, tmp_path / "fp32.json")
    runplan.write_plan(fp8, tmp_path / "fp8.json")
    assert "recipe" not in (tmp_path / "fp32.json").read_text()  # a plan file as before fp8 existed
    assert runplan.read_plan(tmp_path / "fp8.json") == fp8 and runplan.read_plan(tmp_path / "fp32.json") == fp32
    s = setup.build(fp8, {"num_classes": 10, "image_shape": [3, 32, 32]}, torch.device("cpu"))
    assert s.policy.recipe == "rowwise"


def test_an_older_params_yaml_with_fp8_recipe_loads_with_one_line_saying_to_rename_it(tmp_path, capsys):
    """``fp8_recipe`` became ``recipe`` (it names mxfp8's recipes too): an older params.yaml still loads, and an
    fp8 plan file written under the old name still reads."""
    cfg = config.from_dict({"variants": {"fp8": {"precision": "fp8", "fp8_recipe": "rowwise"}}})
    assert cfg.variants["fp8"].recipe == "rowwise"
    assert "variants.fp8.fp8_recipe is now variants.fp8.recipe" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="variants.fp8 sets both fp8_recipe and recipe; delete fp8_recipe"):
        config.from_dict({"variants": {"fp8": {"precision": "fp8", "fp8_recipe": "rowwise", "recipe": "rowwise"}}})
    plan = runplan.make_plan(cfg, "fp8", "cpu")
    runplan.write_plan(plan, tmp_path / "fp8.json")
    old = (tmp_path / "fp8.json").read_text().replace('"recipe"', '"fp8_recipe"')
    (tmp_path / "old.json").write_text(old)
    assert runplan.read_plan(tmp_path / "old.json") == plan


def test_fp8_trains_compiled_on_cuda_by_default_and_eager_on_a_cpu_labelled_so():
    """torchao's float8 is fast only under torch.compile: train.compile auto (the default) compiles fp8 and mxfp8 on
    CUDA (training and the sweep's points), nothing else, and nothing on a CPU; the report labels eager fp8."""
    from ampbench.report import sections, summary, verdict
    v = {"fp32": {"precision": "fp32"}, "f": {"precision": "fp8"}, "m": {"precision": "mxfp8"}}

    def plans(compile_, device):
        cfg = config.from_dict({"train": {"compile": compile_}, "variants": v} if compile_ is not None
                               else {"variants": v})
        return ({n: runplan.make_plan(cfg, n, device).train.compile for n in v},
                {p: runplan.for_precision(cfg, p, device).train.compile for p in ("fp32", "fp8")})
    assert config.from_dict({}).train.compile == "auto"
    # a plan made by hand from a TrainConfig (the benchmarks do) resolves auto too: never the truthy string "auto"
    hand = {"variant": "v", "accum_steps": 1, "seed": 0, "model": config.ModelConfig(), "train": config.TrainConfig(),
            "amp": None}
    assert runplan.RunPlan(precision="fp32", device="cuda", **hand).train.compile is False
    assert runplan.RunPlan(precision="fp8", device="cuda", **hand).train.compile is True
    assert runplan.RunPlan(precision="fp8", device="cpu", **hand).train.compile is False
    assert plans(None, "cuda") == ({"fp32": False, "f": True, "m": True}, {"fp32": False, "fp8": True})
    assert plans(None, "cpu") == ({"fp32": False, "f": False, "m": False}, {"fp32": False, "fp8": False})
    assert plans(False, "cuda") == ({"fp32": False, "f": False, "m": False}, {"fp32": False, "fp8": False})
    assert plans(True, "cuda") == ({"fp32": True, "f": True, "m": True}, {"fp32": False, "fp8": True})
    with pytest.raises(ConfigError, match=r"compile = 'yes' is not allowed; choose one of: true \| false \| auto"):
        config.from_dict({"train": {"compile": "yes"}})
    with pytest.raises(ConfigError, match="train.compile = 1 is not"):
        config.from_dict({"train": {"compile": 1}})
    # the report: an fp8 run that ran uncompiled is labelled eager wherever its figures are
    base = {"accum_steps": 1, "imgs_per_s": 100.0, "step_time_ms": {"median": 10.0}, "peak_mem_bytes": 1,
            "activation_bytes": 1, "epoch_time_s": 1.0, "final_acc": 0.5}
    runs = {"fp32": {"metrics": {**base, "variant": "fp32", "precision": "fp32", "compiled": False}, "history": [],
                     "step_times_ms": [10.0] * 5},
            "f": {"metrics": {**base, "variant": "f", "precision": "fp8", "compiled": False}, "history": [],
                     "step_times_ms": [10.0] * 5}}
    s = summary.summarize(runs)
    assert s["variants"]["f"]["eager"] and not s["variants"]["fp32"]["eager"]
    md = "\n".join(sections.results(s, {"gpu": None}, runs))
    assert "| f | fp8 (eager) | 1 |" in md and "Eager: `f` ran without torch.compile" in md
    assert "f (FP8, eager)" in verdict.verdict({**s, "headline": "f"}, {"gpu": None, "cpu_model": "x"})
    runs["f"]["metrics"]["compiled"] = True
    assert not summary.summarize(runs)["variants"]["f"]["eager"]


@pytest.mark.parametrize(("name", "cap", "refused"), [("NVIDIA A100-SXM4-80GB", (8, 0), True),
                                                     ("NVIDIA GeForce RTX 4090", (8, 9), False),
                                                     ("NVIDIA H200", (9, 0), False)])
def test_fp8_on_a_gpu_before_compute_capability_8_9_is_refused(monkeypatch, name, cap, refused):
    info = _fake_gpu(monkeypatch, name, cap, CU130)
    from ampbench import env
    if not refused:
        assert env.resolve_device("auto", info, {"fp32", "fp8"}) == "cuda"
        return
    with pytest.raises(EnvironmentMismatch) as err:
        env.resolve_device("auto", info, {"fp32", "fp8"})
    msg = str(err.value)
    assert name in msg and "compute capability 8.0" in msg and "8.9 or later" in msg and "\n" not in msg


def _env_check(tmp_path, params: dict) -> subprocess.CompletedProcess:
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    r = tmp_path / "reports"
    return subprocess.run([sys.executable, "stages/env_check.py", "--params", str(tmp_path / "params.yaml"),
                           "--env", str(r / "env.json"), "--plans", str(r / "plans"), "--data-source",
                           str(r / "data_source.json"), "--model-source", str(r / "model_source.json"),
                           "--roofline", str(r / "roofline.json")],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)


def test_env_check_says_what_fp8_converts_and_warns_where_it_cannot_pay(tmp_path):
    base = {"device": "cpu", "data": {"source": "synthetic"}, "mlflow": {"enabled": False},
            "variants": {"fp32": {"precision": "fp32"}, "fp8": {"precision": "fp8"}}}
    out = _env_check(tmp_path, {**base, "model": {"arch": "vit_tiny"}})
    assert out.returncode == 0, out.stderr
    assert "fp8 (tensorwise) runs 12 of the model's layers in float8" in out.stdout
    assert "its widest fp8 layer is 192x768: fp8 pays off only on large GEMMs" in out.stdout
    assert "fp8 on a CPU is emulated" in out.stdout and "and eager (compiling would cost minutes)" in out.stdout
    # the same check in this process (the stage's printing and exit codes: above and in test_bad_input)
    from ampbench.env import check
    _, warned = check.census(config.from_dict({**base, "model": {"arch": "small_cnn"}}), "cpu", 32, 10)
    assert any("fp8 converts no layer of this model" in w and "it would measure bf16" in w for w in warned)
    bad = config.from_dict({**base, "variants": {"fp8": {"precision": "fp8", "recipe": "rowwise_with_gw_hp"}}})
    with pytest.raises(ConfigError, match="variants.fp8.recipe = 'rowwise_with_gw_hp' cannot run on a CPU"):
        check.census(bad, "cpu", 32, 10)


@pytest.mark.slow
def test_fp8_and_mxfp8_run_through_dvc_repro_on_vit_tiny(tmp_path):
    """fp32, fp8 and mxfp8 variants of vit_tiny through the real pipeline: every stage, the profile's fp8 GEMMs in
    conv/matmul, the sweep for each, the report's lines on both, and mxfp8 (a rung added as one module: the
    registry's proof) with every analysis made and its weights saved plain (tf32, bf16 and fp16 through dvc repro:
    test_pipeline; the five rungs side by side in the report: test_report)."""
    import json

    from ampbench import sandbox
    from tests.conftest import SHRINK
    params = sandbox.merge(copy.deepcopy(yaml.safe_load((REPO_ROOT / "params.yaml").read_text())), SHRINK)
    params = sandbox.merge(params, {  # vit_tiny at 16x16: 17 tokens, so mxfp8's micro-batch is a multiple of 32
        "data": {"train_size": 64, "test_size": 32}, "model": {"arch": "vit_tiny", "input_size": 16},
        "train": {"batch_size": 32, "warmup_steps": 1, "eval_batch_size": 32},
        "amp": {"audit_batches": 0}, "profile": {"steps": 1}, "sweep": {"batch_sizes": [32], "steps": 1},
        "mlflow": {"enabled": False}})
    params["variants"] = {"fp32": {"precision": "fp32"}, "fp8": {"precision": "fp8", "recipe": "tensorwise"},
                          "mx": {"precision": "mxfp8", "recipe": "mxfp8_emulated_rceil"}}
    repo = sandbox.create(tmp_path / "repo", params)
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=sandbox.env_with_venv(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fp8 (tensorwise) runs 12 of the model's layers in float8" in proc.stdout
    assert "mxfp8 (mxfp8_emulated_rceil) runs 18 of the model's layers in MX fp8" in proc.stdout
    assert "could not be made" not in proc.stdout, proc.stdout[-3000:]  # every analysis made, for mxfp8 too
    r = repo / "reports"
    runs = {v: json.loads((r / "runs" / v / "metrics.json").read_text()) for v in params["variants"]}
    fp8, mx = runs["fp8"], runs["mx"]
    assert fp8["precision"] == "fp8" and fp8["fp8_layers"] == 12 and fp8["fp8_recipe"] == "tensorwise"  # called
    assert "fp8" in fp8["profile"]["categories"]["conv/matmul"]["dtypes"]  # aten::_scaled_mm, not "other"
    assert mx["precision"] == "mxfp8" and mx["fp8_layers"] == 18 and mx["fp8_recipe"] == "mxfp8_emulated_rceil"
    assert mx["peak_precision"] == "mxfp8" and mx["nonfinite_loss_steps"] == 0 and mx["activation_bytes"] > 0
    # the FLOPs counted on the model unconverted (MX refuses 8 images x 17 tokens): the same as fp32's
    assert mx["train_flops_per_image"] == fp8["train_flops_per_image"] == runs["fp32"]["train_flops_per_image"]
    state = torch.load(r / "runs" / "mx" / "model.pt", weights_only=True)["state_dict"]
    assert all(type(t) is torch.Tensor for t in state.values())  # plain tensors: loads anywhere, LoggedModel too
    sweep = json.loads((r / "sweep" / "sweep.json").read_text())
    assert {p["variant"] for p in sweep["points"]} == {"fp32", "fp8", "mxfp8"}
    md = (r / "report.md").read_text()
    # eager on a CPU, and labelled so wherever its figures are
    assert "fp8 (FP8, eager)" in verdict_of(md) and "| fp8 | fp8 (eager) | 1 |" in md
    assert md.startswith("# FP8, eager: ")  # the title too
    assert "| mx | mxfp8 (eager) | 1 |" in md and "fp8, mxfp8 ran eager" in md  # the sweep's points too
    assert "fp8 has no loss scale" in md and "fp8 (tensorwise) runs 12 Linear layers in float8" in md
    assert "mxfp8 (mxfp8_emulated_rceil) runs 18 Linear layers in MX fp8" in md and "mxfp8 has no loss scale" in md


def test_the_accumulation_check_of_fp8_measures_accumulation_not_fp8s_scaling(tmp_path):
    """fp8 scales each micro-batch by its own amax: on the converted model, two micro-batches' gradients differ from
    the full batch's by fp8's rounding, which the check used to report; it now runs on the model unconverted, where
    they agree to fp32 rounding, as the check is meant to show."""
    from ampbench import data
    from ampbench.train import engine, probes
    data.prepare(config.DataConfig(source="synthetic", train_size=64, test_size=32), 0, tmp_path, tmp_path / "raw")
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "vit_tiny", "input_size": 16},
                            "train": {"epochs": 1, "batch_size": 32, "warmup_steps": 1},
                            "variants": {"fp8": {"precision": "fp8", "accum_steps": 2}}})
    trainer = engine.Trainer(runplan.make_plan(cfg, "fp8", "cpu"), data.load_prepared(tmp_path, "cpu"),
                             progress=False)
    assert trainer.accum_check is not None and trainer.accum_check < 1e-4
    x, y = next(trainer.train_batches.epoch(0))
    with trainer.policy.kernels():  # the converted model's fp8 GEMMs, as its training step runs them on a CPU
        assert probes.accumulation_check(trainer.model, x, y, trainer.micro) > 100 * trainer.accum_check


def test_fp8_rowwise_on_compute_capability_12_waits_for_gpu_validate(tmp_path):
    """cuBLAS' rowwise-scaled fp8 GEMMs are built for 8.9, 9.x and 10.x: on an RTX 5090 env_check refuses a
    rowwise variant with the fix, until `make gpu-validate` has run a rowwise GEMM on that card."""
    import dataclasses
    import json

    from ampbench.env import machine
    rtx = {"gpu": {"name": "NVIDIA GeForce RTX 5090", "capability": "12.0"}}
    cfg = config.from_dict({"variants": {"fp8": {"precision": "fp8", "recipe": "rowwise"},
                                         "tw": {"precision": "fp8"}}})
    plans = {n: dataclasses.replace(runplan.make_plan(cfg, n, "cpu"), device="cuda") for n in cfg.variants}
    with pytest.raises(EnvironmentMismatch, match=r"variants.fp8: fp8 recipe 'rowwise' on NVIDIA GeForce RTX 5090 "
                                                  r"\(compute capability 12.0\).*use recipe: tensorwise"):
        machine.check_recipes("cuda", rtx, plans, tmp_path)
    machine.check_recipes("cuda", {"gpu": {"name": "NVIDIA H100", "capability": "9.0"}}, plans, tmp_path)
    machine.check_recipes("cpu", rtx, plans, tmp_path)  # the CPU's emulation runs it
    record = tmp_path / machine.VALIDATED
    record.parent.mkdir(parents=True)
    found = {"env": rtx, "checks": {"fp8_gemms": {"figure": {"recipes": {"tensorwise": True,
                                                                          "rowwise": "not supported"}}}}}
    record.write_text(json.dumps(found))
    with pytest.raises(EnvironmentMismatch):  # validated, and it failed there
        machine.check_recipes("cuda", rtx, plans, tmp_path)
    found["checks"]["fp8_gemms"]["figure"]["recipes"]["rowwise"] = True
    record.write_text(json.dumps(found))
    machine.check_recipes("cuda", rtx, plans, tmp_path)
    other = {"gpu": {"name": "NVIDIA RTX PRO 6000", "capability": "12.0"}}  # another card's record does not count
    with pytest.raises(EnvironmentMismatch):
        machine.check_recipes("cuda", other, plans, tmp_path)
