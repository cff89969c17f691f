"""DVC's experiment queue: queued experiments log to the repository's own MLflow store, rerun only the stages
whose inputs changed, and are refused when several queue workers would train at once."""

from __future__ import annotations

import copy
import json
import os
import sqlite3
import subprocess
import sys
import time

import pytest
import yaml

from ampbench import env, sandbox
from ampbench.errors import EnvironmentMismatch
from ampbench.sandbox import REPO_ROOT


def _dvc(repo, *args, timeout=600, **output):
    environ = {k: v for k, v in sandbox.env_with_venv().items() if k != "MLFLOW_TRACKING_URI"}  # the repo's store
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=environ, text=True, timeout=timeout,
                          **(output or {"capture_output": True}))


def _ran(repo, n: int) -> bool:
    """Whether ``n`` queued experiments have run: each executor's info file (.dvc/tmp/exps/run/<rev>/<rev>.run)
    says SUCCESS (3) or later once its `dvc repro` has ended (dvc.repo.experiments.executor.base.TaskStatus)."""
    statuses = []
    for info in (repo / ".dvc" / "tmp" / "exps" / "run").glob("*/*.run"):
        try:
            statuses.append(json.loads(info.read_text()).get("status", 0))
        except (OSError, ValueError):  # being written
            return False
    return len(statuses) >= n and all(s >= 3 for s in statuses)


@pytest.mark.slow
def test_queued_experiments_log_to_the_repository_store_and_skip_unchanged_stages(tmp_path):
    from tests.conftest import SHRINK
    params = sandbox.merge(copy.deepcopy(yaml.safe_load((REPO_ROOT / "params.yaml").read_text())), SHRINK)
    params = sandbox.merge(params, {"data": {"train_size": 64, "test_size": 32}, "amp": {"audit_batches": 0},
                                    "profile": {"steps": 0}, "sweep": {"enabled": False},
                                    "mlflow": {"log_model": False}})
    params["variants"] = {"amp": {"precision": "fp16"}}  # the variant the new loss scale is for
    repo = sandbox.create(tmp_path / "repo", params)
    first = _dvc(repo, "repro")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    sandbox.commit(repo, "results")
    model_file = repo / "src" / "ampbench" / "models" / "cifar.py"
    plain = model_file.read_text()
    # one experiment: a new loss scale, and an edit of a model (its stages must run its code, not the workspace's)
    head = "def small_cnn(num_classes: int = 10) -> nn.Module:\n"
    model_file.write_text(plain.replace(head, head + '    print("EDITED small_cnn", flush=True)\n', 1))
    queued = _dvc(repo, "exp", "run", "--queue", "-S", "amp.init_scale=1024", "-n", "scale1024")
    assert queued.returncode == 0, queued.stderr[-2000:]
    model_file.write_text(plain)  # the workspace's edit reverted before the queue runs: the experiment keeps it
    # its output to a file, not a pipe: the worker it starts keeps a pipe open until it exits, idle seconds later
    with open(tmp_path / "queue-start.log", "w") as log:
        started = _dvc(repo, "queue", "start", timeout=120, stdout=log, stderr=subprocess.STDOUT)
    assert started.returncode == 0, (tmp_path / "queue-start.log").read_text()[-2000:]
    deadline = time.time() + 600
    while not _ran(repo, 1):  # read from DVC's files: a `dvc queue status` is a second of CPU taken from training
        assert time.time() < deadline, _dvc(repo, "queue", "status").stdout
        time.sleep(1)
    while True:  # then DVC's own word, once it has collected it
        status = _dvc(repo, "queue", "status").stdout
        if "Running" not in status and "Queued" not in status:
            break
        assert time.time() < deadline, status
        time.sleep(2)
    assert status.count("Success") == 1, status
    log = _dvc(repo, "queue", "logs", "scale1024").stdout
    assert "Running stage 'train@amp'" in log, log  # its loss scale and its code changed
    assert "Stage 'data' didn't change, skipping" in log, log  # its inputs did not
    assert "EDITED small_cnn" in log, log  # the experiment's own code, in env_check and training
    assert "Creating initial MLflow database tables" not in log  # no store of its own in the temporary workspace
    assert "EDITED small_cnn" not in first.stdout + first.stderr
    shown = _dvc(repo, "exp", "show", "--json")
    assert "scale1024" in shown.stdout
    # the comparison a user reads: the changed param and the headline figures that moved, a few dozen columns
    changed = _dvc(repo, "exp", "show", "--only-changed", "--csv")
    header = changed.stdout.splitlines()[0].split(",")
    assert changed.returncode == 0 and len(header) <= 50 and "amp.init_scale" in header, header
    assert any(h.endswith("amp.imgs_per_s") for h in header) and not any("profile" in h for h in header), header
    with sqlite3.connect(repo / "mlflow.db") as db:
        runs = db.execute("SELECT r.name, t.value FROM runs r LEFT JOIN tags t ON t.run_uuid = r.run_uuid "
                          "AND t.key = 'dvc_exp_name'").fetchall()
    assert {(n, e) for n, e in runs if e} == {("train@amp", "scale1024"), ("report", "scale1024")}
    assert sorted(n for n, e in runs if not e) == ["report", "train@amp"]
    assert not list((repo / ".dvc" / "tmp").rglob("mlflow.db"))


def test_several_queue_workers_are_refused_before_training(tmp_path):
    celery = tmp_path / ".dvc" / "tmp" / "exps" / "celery"
    celery.mkdir(parents=True)
    workers = [subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)",
                                 "queue-worker"], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for w in workers:  # until exec has set its command line, /proc shows it empty: wait for each to be up
            assert w.stdout.readline().strip() == "up"
        for i, w in enumerate(workers, 1):
            (celery / f"dvc-exp-worker-{i}.json").write_text(json.dumps({"pid": w.pid}))
        (celery / "dvc-exp-worker-3.json").write_text(json.dumps({"pid": 999_999_999}))  # exited: not counted
        assert env.queue_workers(tmp_path) == 2
        env.check_queue(tmp_path, None)  # not a queued experiment: dvc repro in the workspace
        with pytest.raises(EnvironmentMismatch) as err:
            env.check_queue(tmp_path, "scale1024")
        assert "dvc queue start -j 2" in str(err.value) and "one worker" in str(err.value)
        (tmp_path / "params.yaml").write_text("device: cpu\nmlflow: {enabled: false}\n")
        r = tmp_path / "reports"
        proc = subprocess.run([sys.executable, str(REPO_ROOT / "stages" / "env_check.py"), "--params", "params.yaml",
                               "--env", str(r / "env.json"), "--plans", str(r / "plans"), "--data-source",
                               str(r / "ds.json"), "--model-source", str(r / "ms.json"), "--roofline",
                               str(r / "rl.json")], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "DVC_EXP_NAME": "scale1024", "DVC_ROOT": str(tmp_path)})
        assert proc.returncode == 2 and "dvc queue start -j 2" in proc.stderr and "Traceback" not in proc.stderr
        assert not r.exists()  # refused before anything is written
    finally:
        for w in workers:
            w.kill()
            w.communicate()
