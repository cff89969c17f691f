"""Tracking that fails: an unreachable server is reported fast, training still writes its results, and
`ampbench mlflow-sync` logs them afterwards without duplicates."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from ampbench import config, data, env
from ampbench.sandbox import REPO_ROOT, env_with_venv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_refused_server_is_reported():
    problem = env.check_tracking_server(f"http://127.0.0.1:{_free_port()}", timeout=2)
    assert problem and "refused" in problem.lower()


def test_silent_server_times_out():
    """A server that accepts the connection and never answers: the check gives up after its timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        problem = env.check_tracking_server(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=1)
    assert problem and "did not answer within 1s" in problem


def test_local_stores_need_no_server():
    assert env.check_tracking_server("sqlite:////tmp/x.db") is None


def test_two_clones_get_two_stores(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = config.MlflowConfig()
    assert config.tracking_uri(cfg, tmp_path / "a") != config.tracking_uri(cfg, tmp_path / "b")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://example.invalid:5000")
    assert config.tracking_uri(cfg, tmp_path / "a") == "http://example.invalid:5000"


@pytest.mark.slow
def test_training_survives_tracking_outage_then_syncs_once(tmp_path):
    repo = tmp_path
    reports = repo / "reports"
    data.prepare(config.DataConfig(source="synthetic", train_size=64, test_size=32), 0, repo / "prepared", repo / "r")
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "small_cnn"},
                            "train": {"epochs": 1, "batch_size": 32, "warmup_steps": 1},
                            "variants": {"fp32": {"precision": "fp32", "accum_steps": 1}}})
    config.write_plan(config.make_plan(cfg, "fp32", "cpu"), reports / "plans" / "fp32.json")
    (reports / "env.json").write_text(json.dumps(env.probe()))
    (repo / "params.yaml").write_text("device: cpu\nvariants: {fp32: {precision: fp32, accum_steps: 1}}\n")
    environ = {**env_with_venv(), "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{_free_port()}"}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "stages" / "train.py"), "--plan",
                           str(reports / "plans" / "fp32.json"), "--data", str(repo / "prepared"), "--env",
                           str(reports / "env.json"), "--out", str(reports / "runs" / "fp32"), "--checkpoints",
                           str(repo / "ckpt")], cwd=repo, env=environ, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: MLflow logging of train@fp32 failed" in proc.stdout and "mlflow-sync" in proc.stdout
    assert (reports / "runs" / "fp32" / "metrics.json").is_file()

    store = f"sqlite:///{repo / 'store.db'}"
    sync = [sys.executable, "-m", "ampbench.cli", "mlflow-sync"]
    environ["MLFLOW_TRACKING_URI"] = store
    first = subprocess.run(sync, cwd=repo, env=environ, capture_output=True, text=True, timeout=300)
    second = subprocess.run(sync, cwd=repo, env=environ, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and "MLflow: logged train@fp32" in first.stdout, first.stderr[-2000:]
    assert "already logged: train@fp32" in second.stdout
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("ampbench").experiment_id])
    assert [r.info.run_name for r in runs] == ["train@fp32"]
    assert runs[0].data.params["train.batch_size"] == "32" and "final_acc" in runs[0].data.metrics
