"""Tracking that fails: an unreachable server is reported fast, training still writes its results, and
`ampbench mlflow-sync` logs them afterwards without duplicates, past a sync whose uploads failed."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ampbench import config, data, env, runplan, tracking
from ampbench.errors import ConfigError
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
    runplan.write_plan(runplan.make_plan(cfg, "fp32", "cpu"), reports / "plans" / "fp32.json")
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
    synced_at = int(time.time() * 1000)  # the training's times, not the logging's
    (repo / "mlartifacts").write_text("")  # every upload fails: the run's metrics reach the store, its files not
    broken = subprocess.run(sync, cwd=repo, env=environ, capture_output=True, text=True, timeout=300)
    assert broken.returncode == 1 and "warning: MLflow logging of train@fp32 failed" in broken.stdout, broken.stdout
    (repo / "mlartifacts").unlink()
    first = subprocess.run(sync, cwd=repo, env=environ, capture_output=True, text=True, timeout=300)
    second = subprocess.run(sync, cwd=repo, env=environ, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and "MLflow: logged train@fp32" in first.stdout, first.stderr[-2000:]
    assert "already logged: train@fp32" in second.stdout
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("ampbench").experiment_id])
    assert [r.info.run_name for r in runs] == ["train@fp32"]  # the partial run replaced, not kept beside it
    assert {a.path for a in client.list_artifacts(runs[0].info.run_id)} >= {"metrics.json", "history.csv"}
    assert runs[0].data.params["train.batch_size"] == "32" and "final_acc" in runs[0].data.metrics
    # logged later, the run still says when the training ran, how it ended and what it ran on
    m = json.loads((reports / "runs" / "fp32" / "metrics.json").read_text())
    info = runs[0].info
    assert info.status == "FINISHED" and info.start_time == tracking._ms(m["started_at"])
    assert info.end_time == tracking._ms(m["finished_at"]) and info.start_time < info.end_time < synced_at
    tags = runs[0].data.tags
    assert tags["mlflow.source.name"] == "dvc repro train@fp32" and tags["mlflow.source.git.commit"]
    assert "stages/train.py --plan" in tags["ampbench.command"]
    inputs = {d.dataset.name: d for d in runs[0].inputs.dataset_inputs}
    assert set(inputs) == {"synthetic-train", "synthetic-test"}
    assert {d.tags[0].value for d in inputs.values()} == {"training", "evaluation"}
    digest = data.record(repo / "prepared", json.loads((repo / "prepared" / "meta.json").read_text()))["digest"]
    assert inputs["synthetic-train"].dataset.digest == digest
    assert json.loads(inputs["synthetic-train"].dataset.profile)["num_rows"] == 64
    # the trained model, as a LoggedModel of that run: its metrics linked, loadable, with the weights it trained
    import mlflow
    import torch
    (out,) = runs[0].outputs.model_outputs
    logged = client.get_logged_model(out.model_id)
    assert logged.source_run_id == runs[0].info.run_id and logged.name == "fp32"
    assert {m.key for m in logged.metrics} >= {"final_acc", "imgs_per_s"}
    assert logged.params["precision"] == "fp32" and logged.params["model.arch"] == "small_cnn"
    mlflow.set_tracking_uri(store)
    loaded = mlflow.pytorch.load_model(f"models:/{out.model_id}")
    weights = torch.load(reports / "runs" / "fp32" / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in weights.items())
    # the same model with nothing unpickled from the store: the weights into the architecture built here
    safe = tracking.load_weights(out.model_id, store)
    assert type(safe) is type(loaded) and all(torch.equal(safe.state_dict()[k], v) for k, v in weights.items())
    # a file that names a factory (code in the loader's folder) or an absurd size is refused unless asked for
    from ampbench.errors import ConfigError
    from ampbench.tracking.logged_model import trusted
    record = {"model": {"arch": "small_cnn", "factory": "evil:build"}, "num_classes": 10, "image_size": 32}
    with pytest.raises(ConfigError, match="factory 'evil:build'.*pass factory='evil:build'"):
        trusted(record, "m-1")
    assert trusted(record, "m-1", factory="evil:build") is record
    with pytest.raises(ConfigError, match="asks for 10 classes at 10000000 px"):
        trusted({**record, "model": {"arch": "small_cnn"}, "image_size": 10_000_000}, "m-1")


def test_a_logged_model_pins_the_running_torch_without_scanning_every_installed_package(tmp_path, tmp_mlflow,
                                                                                        monkeypatch):
    """MLflow checks a model's pins by mapping every installed distribution's modules, once in each process: ours
    are read from the modules running, so the model is logged without that scan, its pins as they ran, and
    MLflow's check is back in place afterwards."""
    import mlflow
    import torch
    import torchvision
    from mlflow.utils import environment, requirements_utils

    from ampbench import models
    scans = []
    monkeypatch.setattr(requirements_utils, "_MODULES_TO_PACKAGES", None)  # as in a fresh stage process
    monkeypatch.setattr(requirements_utils.importlib_metadata, "packages_distributions",
                        lambda: scans.append(1) or {})
    check = environment.warn_dependency_requirement_mismatches
    weights = tmp_path / "model.pt"
    torch.save({"state_dict": models.build(config.ModelConfig(arch="small_cnn"), num_classes=10, image_size=32,
                                           device="cpu").state_dict(), "model": {"arch": "small_cnn"},
                "num_classes": 10, "image_size": 32}, weights)
    rid, _ = tracking.log_run(config.MlflowConfig(), tmp_path, run_name="train@fp32", key="k", params={},
                              metrics={"final_acc": 0.5}, tags={}, model=weights)
    client = MlflowClient(tmp_mlflow)
    (out,) = client.get_run(rid).outputs.model_outputs
    folder = mlflow.artifacts.download_artifacts(client.get_logged_model(out.model_id).artifact_location,
                                                 dst_path=str(tmp_path / "logged"))
    pins = (Path(folder) / "requirements.txt").read_text()
    assert f"torch=={torch.__version__.split('+')[0]}" in pins
    assert f"torchvision=={torchvision.__version__.split('+')[0]}" in pins
    assert scans == [] and environment.warn_dependency_requirement_mismatches is check
    with pytest.raises(OSError), tracking._pins_taken_as_read():  # put back when saving fails too
        raise OSError("disk full")
    assert environment.warn_dependency_requirement_mismatches is check


# --- what MLflow 3's UI opens on ----------------------------------------------------------------

def test_experiment_is_marked_as_model_training(tmp_mlflow, tmp_path):
    from ampbench import tracking
    cfg = config.MlflowConfig(experiment="kinds")
    tracking.log_run(cfg, tmp_path, run_name="r", key="k1", params={}, metrics={"x": 1.0}, tags={})
    client = MlflowClient(tmp_mlflow)
    assert client.get_experiment_by_name("kinds").tags[tracking.KIND_TAG] == "custom_model_development"
    old = client.create_experiment("older")  # made before ampbench set the tag: marked on the next log
    tracking.log_run(config.MlflowConfig(experiment="older"), tmp_path, run_name="r", key="k2", params={},
                     metrics={}, tags={})
    assert client.get_experiment(old).tags[tracking.KIND_TAG] == "custom_model_development"
    chosen = client.create_experiment("chosen", tags={tracking.KIND_TAG: "genai_development"})
    assert tracking.prepare_ui(config.MlflowConfig(experiment="chosen"), tmp_mlflow, tmp_path) == chosen
    assert client.get_experiment(chosen).tags[tracking.KIND_TAG] == "genai_development"  # a user's choice stays
    assert tracking.prepare_ui(config.MlflowConfig(experiment="absent"), tmp_mlflow, tmp_path) is None


def test_ui_url_opens_the_runs_table_in_the_model_training_view():
    from ampbench import tracking
    assert tracking.ui_url("http://127.0.0.1:5000/", "3") == \
        "http://127.0.0.1:5000/#/experiments/3/runs?workflowType=machine_learning"
    assert tracking.ui_url("http://h:1", None) == "http://h:1/#/experiments?workflowType=machine_learning"


def test_the_installed_mlflow_ui_reads_what_ampbench_sets():
    """MLflow 3.17's UI picks GenAI or model training from the `workflowType` URL parameter (default genai) and
    reads the experiment's `mlflow.experimentKind` tag; a new MLflow that drops either fails here, not in a browser."""
    import mlflow

    from ampbench import tracking
    js = "".join(p.read_text(errors="ignore") for p in
                 (Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js").glob("main.*.js"))
    assert '"workflowType"' in js and 'MACHINE_LEARNING="machine_learning"' in js
    assert f'"{tracking.KIND_TAG}"' in js and f'CUSTOM_MODEL_DEVELOPMENT="{tracking.KIND}"' in js


def test_mlflow_ui_command_on_a_missing_store_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ampbench.cli", "mlflow-ui", "--store", str(tmp_path / "no.db")],
                          capture_output=True, text=True, env=env_with_venv(), timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "no such file" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_mlflow_ui_prints_its_page_once_the_server_answers_and_its_end_stops_every_process(tmp_path, tmp_mlflow):
    """A closed terminal's SIGHUP (handled as a process manager's SIGTERM and Ctrl-C are: one handler, caught for
    all three): the server and its workers go too. (A SIGKILL: the next test.)"""
    ending = "SIGHUP"
    import signal
    import urllib.request

    import psutil

    from ampbench import tracking
    tracking.log_run(config.MlflowConfig(), tmp_path, run_name="r", key="k", params={}, metrics={"x": 1.0}, tags={})
    store = tmp_mlflow.removeprefix("sqlite:///")
    port = _free_port()
    ui = subprocess.Popen([sys.executable, "-m", "ampbench.cli", "mlflow-ui", "--store", store, "--port", str(port)],
                          cwd=tmp_path, env={k: v for k, v in env_with_venv().items() if k != tracking.JOBS_ENV},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    try:
        lines = []
        for line in ui.stdout:
            lines.append(line)
            if line.startswith("open http"):
                break
        assert lines and lines[-1].startswith(f"open http://127.0.0.1:{port}/#/experiments/"), "".join(lines)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:  # up when it said so
            assert r.status == 200
        family = psutil.Process(ui.pid).children(recursive=True)
        assert family  # the mlflow server and its workers
        # without MLflow's GenAI job runners (7 huey consumers): every process of the server started without them
        assert {p.environ().get(tracking.JOBS_ENV) for p in family} == {"false"}
        assert not [p for p in family if "huey" in " ".join(p.cmdline())]
        # the store's URI (a database's holds its password) in MLflow's variable, on no command line
        assert not [p for p in family if store in " ".join(p.cmdline())]
        assert {p.environ().get("MLFLOW_BACKEND_STORE_URI") for p in family} == {tmp_mlflow}
        caught = int(next(ln for ln in Path(f"/proc/{ui.pid}/status").read_text().splitlines()
                          if ln.startswith("SigCgt:")).split()[1], 16)
        assert all(caught >> (s - 1) & 1 for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)), f"{caught:x}"
        ui.send_signal(getattr(signal, ending))
        assert ui.wait(timeout=60) == (-signal.SIGKILL if ending == "SIGKILL" else 0)
        _, alive = psutil.wait_procs(family, timeout=15)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if ui.poll() is None:  # a failed check: the server (its own session) goes too, not left behind
            with contextlib.suppress(psutil.Error):  # it may end as this runs
                root = psutil.Process(ui.pid)
                for p in [*root.children(recursive=True), root]:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
            ui.wait()


def test_a_server_ampbench_started_ends_when_ampbench_is_sigkilled(tmp_path):
    """No handler sees a SIGKILL: the server learns of it from the kernel (PR_SET_PDEATHSIG, set as it starts in
    ``server.run``, which starts mlflow-ui's and team-server's servers alike), so none is left holding its port."""
    import signal

    import psutil
    starter = ("import os, sys; from ampbench.tracking import server; "
               "server.run([sys.executable, '-c', 'import time; time.sleep(300)'], dict(os.environ), "
               "'http://127.0.0.1:9', 300, 'test server', 'up')")  # port 9 never answers: it waits, the child runs
    parent = subprocess.Popen([sys.executable, "-c", starter], env=env_with_venv(), stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not psutil.Process(parent.pid).children():
            assert parent.poll() is None and time.time() < deadline
            time.sleep(0.05)
        [child] = psutil.Process(parent.pid).children()
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        child.wait(timeout=15)  # psutil.TimeoutExpired if it outlived its parent
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_server_starts_without_mlflow_s_job_runners_unless_the_user_asked_for_them(monkeypatch):
    monkeypatch.delenv(tracking.JOBS_ENV, raising=False)
    assert tracking.server_env()[tracking.JOBS_ENV] == "false"
    monkeypatch.setenv(tracking.JOBS_ENV, "true")
    assert tracking.server_env()[tracking.JOBS_ENV] == "true"


def test_tracking_settings_are_not_in_the_plans_and_passwords_are_never_printed(tmp_path, capsys):
    from ampbench import tracking
    base = {"device": "cpu", "variants": {"fp32": {"precision": "fp32"}}}
    for i, mlflow in enumerate(({}, {"tracking_uri": "postgresql://bob@db:5432/mlflow", "experiment": "x"})):
        cfg = config.from_dict({**base, "mlflow": mlflow})
        runplan.write_plan(runplan.make_plan(cfg, "fp32", "cpu"), tmp_path / f"{i}.json")
    assert (tmp_path / "0.json").read_text() == (tmp_path / "1.json").read_text()  # a new server retrains nothing
    assert "mlflow" not in json.loads((tmp_path / "0.json").read_text())
    assert config.redact("postgresql://bob:hunter2@db:5432/mlflow") == "postgresql://bob:***@db:5432/mlflow"
    assert config.redact("http://h:5000/?token=abc&x=1") == "http://h:5000/?token=***&x=1"
    assert config.redact("sqlite:////tmp/m.db") == "sqlite:////tmp/m.db"
    for uri in ("postgresql://bob:hunter2@db:5432/mlflow", "https://h:5000/?token=hunter2"):  # params.yaml is in git
        with pytest.raises(ConfigError, match="holds a password.*set the URI in the environment") as refused:
            config.from_dict({**base, "mlflow": {"tracking_uri": uri}})
        assert "hunter2" not in str(refused.value) and "***" in str(refused.value)

    def failing():
        raise ConnectionError("could not connect to postgresql://bob:hunter2@db:5432/mlflow")
    assert tracking.safely("train@fp32", lambda cfg, root: failing(), config.MlflowConfig(), tmp_path) is None
    out = capsys.readouterr().out
    assert "bob:***@db" in out and "hunter2" not in out
