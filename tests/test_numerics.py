"""Numerical safety: skipped overflow steps, non-finite losses, the first bad layer, the fp16 audit."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from ampbench import config, data, models, runplan
from ampbench.errors import NonFiniteTraining, run_cli
from ampbench.train import numerics, runner, step


def test_fp16_fractions_of_known_values_are_exact():
    t = torch.tensor([1.0, 70000.0, 1e-9, 1e-6, 0.0, -80000.0, 3e-8, 2.0 ** -25, 6e-5, 1e-4])
    # overflow: 7e4, -8e4; flush to zero: 1e-9 and 2^-25 (a tie, rounded to even = 0);
    # subnormal: 1e-6, 3e-8 (rounds up to 2^-24), 6e-5
    assert numerics.fp16_fractions(t) == {"overflow": 0.2, "underflow": 0.2, "subnormal": 0.3}
    # scaled by 1024: nothing flushes to zero any more; 1e-9, 3e-8 and 2^-25 are now subnormal, 1e-6 and 6e-5
    # normal; nothing new overflows
    assert numerics.fp16_fractions(t, 1024.0) == {"overflow": 0.2, "underflow": 0.0, "subnormal": 0.3}


class Poison(nn.Module):
    """Wraps a layer; its output turns to NaN from the ``after``-th call on."""

    def __init__(self, inner: nn.Module, after: int = 0):
        super().__init__()
        self.inner, self.after, self.calls = inner, after, 0

    def forward(self, x):
        self.calls += 1
        out = self.inner(x)
        return out * float("nan") if self.calls > self.after else out


def _poisoned_build(after: int):
    real = models.build

    def build(cfg, **kw):
        model = real(cfg, **kw)
        model[2][0] = Poison(model[2][0], after)  # the second block's convolution: module "2.0"
        return model

    return build


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    data.prepare(config.DataConfig(source="synthetic", train_size=64, test_size=32), 0, out, out / "raw")
    return data.load_prepared(out, "cpu")


def _plan(variant="amp", precision="fp16", **extra):
    raw = {"device": "cpu", "model": {"arch": "small_cnn", "channels_last": False},
           "train": {"epochs": 2, "batch_size": 16, "warmup_steps": 1},
           "amp": {"max_consecutive_nonfinite": 3, "audit_batches": 1}, "profile": {"steps": 0},
           "variants": {variant: {"precision": precision, "accum_steps": 1}}}
    for key, value in extra.items():
        raw[key] = {**raw.get(key, {}), **value}
    return runplan.make_plan(config.from_dict(raw), variant, "cpu")


def test_overflowing_step_is_skipped_with_weights_unchanged(tiny, monkeypatch):
    real = step.accumulate_gradients
    snapshots = []

    def poisoned(model, *args):
        snapshots.append([p.detach().clone() for p in model.parameters()])
        loss = real(model, *args)
        if len(snapshots) == 2:  # the second step overflows
            next(model.parameters()).grad[0].fill_(float("inf"))
        return loss

    monkeypatch.setattr(step, "accumulate_gradients", poisoned)
    result = runner.train(_plan(), tiny, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2], strict=True))  # step 2 skipped
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[0], snapshots[1], strict=True))
    m = result.metrics
    assert m["skipped_steps"] == 1 and m["nonfinite_loss_steps"] == 0 and m["final_loss_scale"] == 4096
    assert result.scale_history[1] == {"step": 2, "scale": 4096.0, "skipped": True}


def test_persistent_nan_names_the_layer_and_stops(tiny, monkeypatch):
    monkeypatch.setattr(models, "build", _poisoned_build(after=0))
    with pytest.raises(NonFiniteTraining) as err:
        runner.train(_plan(), tiny, progress=False)
    msg = str(err.value)
    assert "3 steps in a row had an inf/NaN loss" in msg and "first module with an inf/NaN output: 2.0" in msg
    assert err.value.result.metrics["diagnosis"]["first_bad_module"] == "2.0"
    assert err.value.result.metrics["nonfinite_loss_steps"] == 3 and err.value.exit_code == 3


def test_the_advice_of_a_stop_fits_the_cause_the_diagnosis_found(tiny, monkeypatch):
    """An activation that turns NaN under fp16 with finite weights points at fp16's range, not the learning rate; an
    update that wrote inf weights points at the step's size; one after skipped steps of a fused optimizer at its
    state first (a fused kernel skips by returning early)."""
    with pytest.raises(NonFiniteTraining) as err:
        monkeypatch.setattr(models, "build", _poisoned_build(after=0))
        runner.train(_plan(), tiny, progress=False)
    msg = str(err.value)
    assert "in fp16 that is most often an activation past fp16's range" in msg and "Train this variant in bf16" in msg
    assert "wrote inf/NaN weights" not in msg
    monkeypatch.undo()
    with pytest.raises(NonFiniteTraining) as err:  # a learning rate no model survives: weights inf after a step
        runner.train(_plan("fp32", "fp32", train={"lr": 1e30}), tiny, progress=False)
    msg = str(err.value)
    assert "An optimizer step wrote inf/NaN weights" in msg and "Lower train.lr" in msg and "bf16" not in msg
    assert err.value.result.metrics["diagnosis"]["nonfinite_params"]
    d = {"nonfinite_params": ["0.weight"], "first_bad_module": "0"}
    fused = numerics.advice(d, "fp16", "fused", skipped=1)
    assert "optimizer_impl: foreach to rule that out first" in fused and "skipped 1 step(s)" in fused
    assert "optimizer_impl" not in numerics.advice(d, "fp16", "foreach", skipped=1)
    state = numerics.advice({"nonfinite_state": ["0.weight"], "nonfinite_params": []}, "fp32", "fused")
    assert state.startswith("The optimizer's state is inf/NaN while the weights are finite")
    unmade = {"nonfinite_params": [], "first_bad_module": None, "not_made": "OutOfMemoryError: CUDA out of memory"}
    assert "could not be replayed to find the cause (OutOfMemoryError" in numerics.advice(unmade, "fp16", "fused")
    assert "did not persist" not in numerics.advice(unmade, "fp16", "fused")
    assert "could not be replayed" in numerics.describe(unmade) and "none found" not in numerics.describe(unmade)
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    opt.state[w]["momentum_buffer"] = torch.tensor([float("nan"), 0.0])
    assert numerics.nonfinite_state(nn.ParameterList([w]), opt) == ["0"]


def test_fp32_nan_is_caught_without_a_scaler(tiny, monkeypatch):
    monkeypatch.setattr(models, "build", _poisoned_build(after=0))
    with pytest.raises(NonFiniteTraining, match="training loss became inf/NaN"):
        runner.train(_plan("fp32", "fp32"), tiny, progress=False)


@pytest.mark.filterwarnings("ignore:Error detected in:UserWarning")  # detect_anomaly prints the forward trace
def test_detect_anomaly_reports_the_failing_op(tiny, monkeypatch):
    monkeypatch.setattr(models, "build", _poisoned_build(after=0))
    with pytest.raises(NonFiniteTraining, match="detect_anomaly"):
        runner.train(_plan("fp32", "fp32", debug={"detect_anomaly": True}), tiny, progress=False)


def test_stage_exits_3_and_keeps_completed_epochs(tiny, tmp_path, monkeypatch, capsys):
    out, ckpt = tmp_path / "runs" / "amp", tmp_path / "ckpt"
    runplan.write_plan(_plan(), tmp_path / "amp.json")
    (tmp_path / "params.yaml").write_text("mlflow: {enabled: false}\n")  # where the stage reads tracking settings
    data.prepare(config.DataConfig(source="synthetic", train_size=64, test_size=32), 0, tmp_path / "p", tmp_path / "r")
    (tmp_path / "env.json").write_text(json.dumps({"torch": "x", "cuda_runtime": None, "gpu": None,
                                                   "cpu_model": "cpu"}))
    monkeypatch.setattr(models, "build", _poisoned_build(after=4))  # epoch 1 (4 steps) is clean
    from tests.conftest import load_stage
    stage = load_stage("train")
    monkeypatch.setattr(sys, "argv", ["train.py", "--plan", str(tmp_path / "amp.json"), "--data",
                                      str(tmp_path / "p"), "--env", str(tmp_path / "env.json"), "--out", str(out),
                                      "--checkpoints", str(ckpt), "--params", str(tmp_path / "params.yaml")])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(stage.main)
    assert exit_info.value.code == 3
    err = capsys.readouterr().err
    assert "first module with an inf/NaN output: 2.0" in err and "Traceback" not in err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "stopped: non-finite loss" and metrics["diagnosis"]["first_bad_module"] == "2.0"
    assert len((out / "history.csv").read_text().splitlines()) == 2  # header + the completed epoch
    assert (ckpt / "repeat1" / "last.pt").is_file()


def test_audit_rows(tiny):
    result = runner.train(_plan(), tiny, progress=False)
    rows = {r["layer"]: r for r in result.numerics}
    conv = rows["0.0"]
    assert conv["autocast_dtype"] == "float16" and conv["type"] == "Conv2d"
    for key in ("act_overflow", "grad_underflow", "grad_scaled_underflow", "grad_subnormal"):
        assert 0.0 <= conv[key] <= 1.0
    # scaling by 8192 can only move gradients out of the flush-to-zero range
    assert all(r["grad_scaled_underflow"] <= r["grad_underflow"] for r in result.numerics)


def test_accumulation_check_in_metrics(tiny):
    m = runner.train(_plan("acc", "fp16", variants={"acc": {"precision": "fp16", "accum_steps": 4}}), tiny,
                     progress=False).metrics
    assert m["accum_grad_max_rel_diff"] < 1e-5
