"""No analysis stops the pipeline: each one, made to fail (AMPBENCH_FAIL_ANALYSIS), is a warning, a run that goes
on, and a report section that says what could not be made and why; a real failure is treated the same."""

from __future__ import annotations

import json

import pytest
import torch

from ampbench import config, data, errors, models, report, results, runplan, sweep
from ampbench.train import runner

FAIL = errors.FAIL_ON_PURPOSE


def test_analysis_returns_the_result_or_warns_in_one_line(monkeypatch, capsys):
    assert errors.analysis("audit", "m", lambda a, b=0: a + b, 1, b=2) == (3, None)
    result, why = errors.analysis("audit", "resnet9", lambda: 1 / 0)
    assert result is None and why == "ZeroDivisionError: division by zero"
    out = capsys.readouterr().out
    assert out == "warning: the numerics audit could not be made for resnet9 (ZeroDivisionError: division by zero)\n"
    monkeypatch.setenv(FAIL, "profile,audit")
    assert errors.analysis("audit", "m", lambda: 1)[0] is None and errors.analysis("flops", "m", lambda: 1)[0] == 1
    monkeypatch.setenv(FAIL, "all")
    assert errors.analysis("flops", "m", lambda: 1)[1].startswith("RuntimeError: failed on purpose")

    monkeypatch.delenv(FAIL)

    def interrupted():
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C is never an analysis's failure
        errors.analysis("profile", "m", interrupted)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    data.prepare(config.DataConfig(source="synthetic", train_size=64, test_size=32), 0, out, out / "raw")
    return data.load_prepared(out, "cpu")


@pytest.mark.parametrize("name", ["accumulation", "activations", "flops", "audit", "profile"])
def test_a_failed_analysis_of_a_training_run_is_said_and_training_goes_on(tiny_params, tiny_data, monkeypatch,
                                                                           capsys, tmp_path, name):
    monkeypatch.setenv(FAIL, name)
    tiny_params["profile"] = {"steps": 2 if name == "profile" else 0}  # emulated fp16 steps: only where it fails
    plan = runplan.make_plan(config.from_dict(tiny_params), "amp_accum", "cpu")
    result = runner.train(plan, tiny_data, progress=False)
    m = result.metrics
    assert set(m["not_made"]) == {name} and "failed on purpose" in m["not_made"][name]
    assert m["optimizer_steps"] == 2 and m["final_acc"] is not None  # the training itself is whole
    key = {"accumulation": "accum_grad_max_rel_diff", "activations": "activation_bytes",
           "flops": "achieved_tflops"}.get(name)
    if key:
        assert m[key] is None
    assert (result.numerics == []) == (name == "audit") and (m.get("profile", {}).get("error") is not None) == (
        name == "profile")
    assert "could not be made for small_cnn (amp_accum) (RuntimeError: failed on purpose" in capsys.readouterr().out
    results.write_run(tmp_path / "runs" / "amp_accum", m, result.tables(), result.step_times_ms)
    s = report.build(tmp_path / "runs", {"gpu": None, "torch": "2"}, tmp_path / "r.md", tmp_path / "s.json",
                     tmp_path / "fig", ["amp_accum"])
    md = (tmp_path / "r.md").read_text()
    assert f"{errors.ANALYSES[name][0].upper()}{errors.ANALYSES[name][1:]} could not be made for `amp_accum`: " \
           "RuntimeError: failed on purpose" in md, md
    assert s["variants"]["amp_accum"]["not_made"] == m["not_made"]
    assert s["figures_not_drawn"] == {} and s["figures"]  # every figure drawn without what is missing


def test_a_sweep_point_and_the_largest_batch_that_fail_are_said_and_not_kept(tiny_params, tiny_data, tmp_path,
                                                                             monkeypatch, capsys):
    tiny_params["sweep"] = {"batch_sizes": [4, 8], "steps": 1, "precisions": ["fp32"]}
    cfg = config.from_dict(tiny_params)
    monkeypatch.setenv(FAIL, "sweep")
    out = sweep.run_sweep(cfg, tiny_data, torch.device("cpu"), tmp_path / "sweep", "env", {"model": "small_cnn"})
    assert [(p["batch_size"], p["error"].startswith("RuntimeError: failed on purpose")) for p in out["not_made"]] \
        == [(4, True), (8, True)]
    assert out["points"] == [] and not list((tmp_path / "sweep" / "points").glob("*.json"))  # tried again next time
    monkeypatch.delenv(FAIL)
    sweep.run_sweep(cfg, tiny_data, torch.device("cpu"), tmp_path / "sweep", "env", {"model": "small_cnn"})
    kept = sorted(p.name for p in (tmp_path / "sweep" / "points").glob("*.json"))
    monkeypatch.setenv(FAIL, "sweep")  # a setup that fails later leaves the points measured before
    sweep.run_sweep(cfg, tiny_data, torch.device("cpu"), tmp_path / "sweep", "env", {"model": "small_cnn"})
    assert kept == ["fp32-4.json", "fp32-8.json"] == sorted(p.name for p in (tmp_path / "sweep" / "points").glob("*"))
    for p in (tmp_path / "sweep" / "points").glob("*"):
        p.unlink()
    assert "a sweep point could not be made for small_cnn (fp32: its setup) (RuntimeError" in capsys.readouterr().out
    monkeypatch.delenv(FAIL)
    real = sweep.Bench.point

    def point(bench, batch, steps):  # one point breaks for real, the other is measured
        if batch == 8:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return real(bench, batch, steps)
    monkeypatch.setattr(sweep.Bench, "point", point)
    out = sweep.run_sweep(cfg, tiny_data, torch.device("cpu"), tmp_path / "sweep", "env", {"model": "small_cnn"})
    assert [p["batch_size"] for p in out["points"]] == [4] and out["not_made"][0]["batch_size"] == 8
    assert "a sweep point could not be made for small_cnn (fp32, batch 8) (AcceleratorError: CUDA error" \
        in capsys.readouterr().out
    monkeypatch.setattr(sweep.Bench, "point", real)
    monkeypatch.setenv(FAIL, "largest_batch")
    out = sweep.run_sweep(cfg, tiny_data, torch.device("cpu"), tmp_path / "sweep", "env", {"model": "small_cnn"})
    assert out["not_made"] == [] and len(out["points"]) == 2
    assert out["largest"]["fp32"]["method"] == "failed" and out["largest"]["fp32"]["largest_batch"] is None
    monkeypatch.delenv(FAIL)  # a failed search is not reused: it runs again
    out = sweep.run_sweep(cfg, tiny_data, torch.device("cpu"), tmp_path / "sweep", "env", {"model": "small_cnn"})
    assert out["largest"]["fp32"]["method"] == "estimate" and out["reused_points"] == 2
    md = report.scale.sweep({"sweep": report.summary.sweep({**out, "not_made": [{"precision": "fp16",
                                                                                "batch_size": 8, "error": "E: x"}]})},
                            {}, {})
    assert "Could not be made: fp16 at batch 8 (E: x)." in md


def test_a_figure_that_fails_leaves_the_others_and_the_report(tmp_path, monkeypatch, capsys):
    from tests.test_report import _write
    runs = tmp_path / "runs"
    _write(runs, "fp32", "fp32", 1, 300.0, 1000, 400, 0.90)
    _write(runs, "amp", "fp16", 1, 100.0, 600, 200, 0.89)
    from ampbench.report import figures
    real = figures.memory
    monkeypatch.setattr(figures, "memory", lambda *a: (_ for _ in ()).throw(ValueError("no axis")))
    s = report.build(runs, {"gpu": None}, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "amp"])
    assert s["figures_not_drawn"] == {"memory.png": "ValueError: no axis"}
    assert "figures/memory.png" not in s["figures"] and any("throughput" in f for f in s["figures"])
    assert "Figure memory.png could not be drawn: ValueError: no axis." in (tmp_path / "r.md").read_text()
    monkeypatch.setattr(figures, "memory", real)
    monkeypatch.setenv(FAIL, "figures")
    s = report.build(runs, {"gpu": None}, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "amp"])
    assert s["figures"] == [] and "throughput.png" in s["figures_not_drawn"]
    assert "the figures could not be made" in capsys.readouterr().out


def test_a_logged_model_that_fails_leaves_the_run_logged_and_tagged(tmp_path, tmp_mlflow, monkeypatch):
    from mlflow.tracking import MlflowClient

    from ampbench import tracking
    weights = tmp_path / "model.pt"
    torch.save({"state_dict": {}, "model": {"arch": "small_cnn"}, "num_classes": 10, "image_size": 32}, weights)
    monkeypatch.setenv(FAIL, "logged_model")
    rid, new = tracking.log_run(config.MlflowConfig(), tmp_path, run_name="train@amp", key="k1", params={"a": 1},
                                metrics={"final_acc": 0.5}, tags={}, model=weights)
    run = MlflowClient(tmp_mlflow).get_run(rid)
    assert new and run.info.status == "FINISHED" and run.data.metrics["final_acc"] == 0.5
    assert run.data.tags["ampbench.logged_model"].startswith("not logged: RuntimeError: failed on purpose")
    monkeypatch.delenv(FAIL)  # a real failure inside MLflow's log_model: the LoggedModel is marked FAILED
    import mlflow.pytorch
    monkeypatch.setattr(mlflow.pytorch, "log_model", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    torch.save({"state_dict": models.build(config.ModelConfig(arch="small_cnn"), num_classes=10, image_size=32,
                                           device="cpu").state_dict(), "model": {"arch": "small_cnn"},
                "num_classes": 10, "image_size": 32}, weights)
    rid, _ = tracking.log_run(config.MlflowConfig(), tmp_path, run_name="train@amp", key="k2", params={"a": 1},
                              metrics={"final_acc": 0.5}, tags={}, model=weights)
    client = MlflowClient(tmp_mlflow)
    run = client.get_run(rid)
    assert run.info.status == "FINISHED" and "OSError: disk full" in run.data.tags["ampbench.logged_model"]
    (logged,) = client.search_logged_models([run.info.experiment_id])
    assert logged.status.name == "FAILED" and logged.source_run_id == rid


def test_a_roofline_that_cannot_count_the_model_leaves_env_check_whole(tmp_path, tiny_params, monkeypatch):
    import subprocess
    import sys

    import yaml

    from ampbench.sandbox import REPO_ROOT, env_with_venv
    tiny_params["variants"]["fp8"] = {"precision": "fp8", "accum_steps": 1, "recipe": "tensorwise"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params))
    env = {**env_with_venv(), FAIL: "roofline,fp8_census"}
    r = tmp_path / "reports"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "stages" / "env_check.py"), "--env", str(r / "env.json"),
                           "--plans", str(r / "plans"), "--data-source", str(r / "ds.json"), "--model-source",
                           str(r / "ms.json"), "--roofline", str(r / "roofline.json")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: the roofline count could not be made for small_cnn (RuntimeError: failed on purpose" \
        in proc.stdout and "Traceback" not in proc.stderr
    found = json.loads((r / "roofline.json").read_text())
    assert found["error"].startswith("RuntimeError: failed on purpose")
    assert found["fp8"]["error"].startswith("RuntimeError: failed on purpose")
    assert "warning: the census of what fp8 converts could not be made for small_cnn" in proc.stdout
    assert sorted(p.name for p in (r / "plans").iterdir()) == sorted(f"{v}.json" for v in tiny_params["variants"])


@pytest.mark.slow
def test_every_analysis_failing_at_once_still_gives_a_report(tmp_path, tiny_params, monkeypatch):
    """The whole pipeline, every analysis made to fail: every stage finishes, the report says what is missing (the
    fp8 census is env_check's, tested above with an fp8 variant)."""
    import subprocess
    import sys

    from ampbench import sandbox
    tiny_params["variants"] = {"fp32": {"precision": "fp32", "accum_steps": 1},
                               "amp_accum": {"precision": "fp16", "accum_steps": 2}}
    tiny_params["data"].update(train_size=64, test_size=32)
    tiny_params["profile"] = {"steps": 1}
    tiny_params["mlflow"]["log_model"] = True  # its failure too
    repo = sandbox.create(tmp_path / "repo", tiny_params)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, capture_output=True, text=True,
                          timeout=900, env={**sandbox.env_with_venv(), FAIL: "all"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    # no sweep made, no largest batch to search; no fp8 variant; the paired check off (its failure: test_steadiness)
    skipped = ("largest_batch", "fp8_census", "paired")
    for name, what in errors.ANALYSES.items():  # each one warned of, in one line
        assert name in skipped or f"warning: {what} could not be made for " in proc.stdout, what
    md = (repo / "reports" / "report.md").read_text()
    for line in ("Not counted: RuntimeError: failed on purpose", "The step profile could not be made for `fp32`",
                 "The accumulation check could not be made for `amp_accum`", "Could not be made: fp32 at batch 8",
                 "The numerics audit could not be made for `amp_accum`", "Figure throughput.png could not be drawn",
                 "The activation-memory meter could not be made for `fp32`",
                 "The FLOP count could not be made for `amp_accum`"):
        assert line in md, line
    summary = json.loads((repo / "reports" / "summary.json").read_text())
    assert summary["variants"]["amp_accum"]["speedup"] > 0  # what training measured is all there
