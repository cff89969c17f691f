"""A team: one `mlflow server` backed by a real PostgreSQL, serving artifacts, two machines (two clones that present
different machines) running the pipeline into it over http://, and `ampbench compare` putting them side by side.

PostgreSQL comes from Debian's `postgresql` package (`make test` installs it where it can); without it this test
skips with its reason, except under CI=true, where it fails.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from ampbench import sandbox, tracking
from ampbench.sandbox import REPO_ROOT

PG_BINS = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))
PASSWORD = "hunter2-team"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _missing(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run the team test (make test installs Debian's postgresql)")
    pytest.skip(reason)


def _as_postgres(cmd: list[str]) -> list[str]:
    """initdb and postgres refuse to run as root: CI runs as root, so they run as the postgres user there."""
    if os.geteuid() != 0:
        return cmd
    return ["runuser", "-u", "postgres", "--", *cmd]


@pytest.fixture(scope="module")
def postgres():
    """A throwaway cluster on a loopback port with a password, and a database for MLflow; its URI."""
    if not PG_BINS:
        _missing("PostgreSQL is not installed (/usr/lib/postgresql/<version>/bin); apt-get install postgresql")
    if os.geteuid() == 0 and not shutil.which("runuser"):
        _missing("running as root without runuser to start PostgreSQL as the postgres user")
    pg = Path(PG_BINS[-1])
    root = Path(tempfile.mkdtemp(prefix="ampbench-pg-"))  # not under pytest's 0700 folder: postgres must reach it
    data, sock, pwfile = root / "data", root / "sock", root / "pw"
    sock.mkdir()
    pwfile.write_text(PASSWORD + "\n")
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        for p in (sock, pwfile):
            shutil.chown(p, "postgres")
        root.chmod(0o755)
    port = _free_port()
    subprocess.run(_as_postgres([str(pg / "initdb"), "-D", str(data), "-U", "postgres", "--auth=scram-sha-256",
                                 f"--pwfile={pwfile}", "-E", "UTF8", "--no-locale"]),
                   check=True, capture_output=True, timeout=120)
    subprocess.run(_as_postgres([str(pg / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-o",
                                 f"-p {port} -k {sock} -c listen_addresses=127.0.0.1", "start"]),
                   check=True, capture_output=True, timeout=120)
    try:
        env = {**os.environ, "PGPASSWORD": PASSWORD}
        subprocess.run([str(pg / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "mlflow"],
                       check=True, capture_output=True, env=env, timeout=60)
        yield SimpleNamespace(uri=f"postgresql://postgres:{PASSWORD}@127.0.0.1:{port}/mlflow", port=port,
                              stop=lambda: subprocess.run(_as_postgres([str(pg / "pg_ctl"), "-D", str(data), "-m",
                                                                        "fast", "stop"]), capture_output=True,
                                                          timeout=120))
    finally:
        subprocess.run(_as_postgres([str(pg / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"]),
                       capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server(postgres, tmp_path_factory):
    """`mlflow server` on the cluster, serving artifacts from its own folder; its http:// URI."""
    port = _free_port()
    artifacts = tmp_path_factory.mktemp("artifacts")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", postgres.uri,
                             "--serve-artifacts", "--artifacts-destination", str(artifacts), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"],
                            env={**sandbox.env_with_venv(), tracking.JOBS_ENV: "false"},  # as docs/team.md runs it
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "mlflow server did not start"
                time.sleep(0.5)
        yield base, artifacts
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)


MACHINES = {"a": {"cpu_model": "Team machine A (test)", "driver": "580.65.06"},
            "b": {"cpu_model": "Team machine B (test)", "driver": "575.51.03"}}


@pytest.mark.slow
def test_two_machines_log_to_one_postgres_backed_server_and_compare(server, tmp_path):
    from tests.conftest import SHRINK
    base, artifacts = server
    params = sandbox.merge(copy.deepcopy(yaml.safe_load((REPO_ROOT / "params.yaml").read_text())), SHRINK)
    params = sandbox.merge(params, {"data": {"train_size": 64, "test_size": 32}, "amp": {"audit_batches": 0},
                                    "profile": {"steps": 0}, "sweep": {"enabled": False},
                                    "mlflow": {"experiment": "team", "log_model": False}})
    params["variants"] = {"fp32": {"precision": "fp32"}, "bf16": {"precision": "bf16"}}
    for name, machine in MACHINES.items():
        repo = sandbox.create(tmp_path / name, params)
        environ = {**sandbox.env_with_venv(), "MLFLOW_TRACKING_URI": base,
                   "AMPBENCH_PROBE_OVERRIDE": json.dumps(machine)}
        proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=environ, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "MLflow: logged train@bf16" in proc.stdout and "warning: MLflow" not in proc.stdout
        assert PASSWORD not in proc.stdout + proc.stderr
    assert list(artifacts.rglob("metrics.json"))  # artifacts went through the server, to its folder

    out = tmp_path / "compare"
    proc = subprocess.run([sys.executable, "-m", "ampbench.cli", "compare", "--experiment", "team", "--out",
                           str(out)], cwd=tmp_path / "a", env={**sandbox.env_with_venv(), "MLFLOW_TRACKING_URI": base},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    page = out.with_suffix(".md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| Team machine")]
    assert len(rows) == 2 and "580.65.06" in rows[0] and "575.51.03" in rows[1], page
    assert all(" bf16 |" in page and "x (" in row for row in rows)  # a speedup with its interval per machine
    assert out.with_suffix(".png").is_file()
    print(page)


@pytest.mark.slow
def test_a_database_that_is_down_or_refuses_us_fails_fast_without_printing_its_password(server, postgres, tmp_path):
    from ampbench import env
    base, _ = server
    assert env.check_tracking_server(base) is None and env.check_tracking_server(postgres.uri) is None
    wrong = postgres.uri.replace(PASSWORD, "not-the-password")
    problem = env.check_tracking_server(wrong)
    assert problem and "password authentication failed" in problem and "not-the-password" not in problem
    (tmp_path / "params.yaml").write_text("device: cpu\nmlflow: {experiment: team}\n")
    r = tmp_path / "reports"
    check = [sys.executable, str(REPO_ROOT / "stages" / "env_check.py"), "--params", "params.yaml", "--env",
             str(r / "env.json"), "--plans", str(r / "plans"), "--data-source", str(r / "ds.json"), "--model-source",
             str(r / "ms.json"), "--roofline", str(r / "rl.json")]
    proc = subprocess.run(check, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**sandbox.env_with_venv(), "MLFLOW_TRACKING_URI": wrong})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "is a database this machine would write to directly" in out
    assert "password authentication failed" in out and "postgres:***@127.0.0.1" in out
    assert "not-the-password" not in out and PASSWORD not in out
    postgres.stop()  # the server stays up, its database goes
    problem = env.check_tracking_server(base)
    assert problem and problem.startswith("answers, but not for its runs (HTTP 5") and "database" in problem
    assert PASSWORD not in problem
