"""A team: `ampbench team-server` (MLflow's basic-auth app over TLS) backed by a real PostgreSQL, serving artifacts,
an account per machine, two machines (two clones that present different machines) running the pipeline into it
over https://, and `ampbench compare` putting them side by side; the refusals (no credentials, a missing right, a
certificate not trusted) each said in one line, and no password in a command line or a report. The server under
load and faults: three machines logging at once through its restart (the load benchmark's smallest round), a
full artifact disk, a database down at its start; each failure said in one line, each run in the store once.

PostgreSQL comes from Debian's `postgresql` package (`make test` installs it where it can); without it this test
skips with its reason, except under CI=true, where it fails.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from ampbench import sandbox
from ampbench.sandbox import REPO_ROOT

PASSWORD = "hunter2-team"
ADMIN, ALICE, BOB = "admin-pw-team-1", "alice-pw-team-1", "bob-pw-team-12"  # every password the test gives
SECRETS = (PASSWORD, ADMIN, ALICE, BOB)
TRACKING = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_SERVER_CERT_PATH", "MLFLOW_TRACKING_USERNAME",
            "MLFLOW_TRACKING_PASSWORD")


def _benchmark(name: str):
    """benchmarks/<name>.py as a module: the load benchmark, and through it its throwaway team (a PostgreSQL
    cluster, a certificate, `ampbench team-server`, accounts: benchmarks/teamserver.py)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO_ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LOAD = _benchmark("load")
TEAM = LOAD.teamserver


def _missing(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run the team test (make test installs Debian's postgresql)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def postgres():
    """A throwaway cluster on a loopback port with a password, a database for the runs and one for the accounts:
    its URIs (uri, auth_uri), stop(), start(), restart()."""
    if not TEAM.PG_BINS:
        _missing("PostgreSQL is not installed (/usr/lib/postgresql/<version>/bin); apt-get install postgresql")
    if os.geteuid() == 0 and not shutil.which("runuser"):
        _missing("running as root without runuser to start PostgreSQL as the postgres user")
    cluster = TEAM.Cluster(PASSWORD)
    try:
        yield cluster
    finally:
        cluster.close()


def _passwords_in_command_lines() -> list[str]:
    """Every process's command line that holds a password of the test's (what `ps` shows any local user)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found += [text[:200] for secret in SECRETS if secret in text]
    return found


@pytest.fixture(scope="module")
def server(postgres, tmp_path_factory):
    """`ampbench team-server` as docs/team.md starts it: basic-auth on the cluster (accounts in a database of
    their own), TLS with the test's certificate, artifacts served from its own folder; the databases' URIs and the
    admin's first password in the environment. Then, as the doc's admin: alice with EDIT on experiment `team`, bob
    with READ. (its https:// URI, the artifacts' folder, the CA's file, an environment per account, the server)"""
    team = TEAM.TeamServer(tmp_path_factory.mktemp("server"), postgres, ADMIN, workers=1)
    try:
        assert not _passwords_in_command_lines()  # the server's processes, started
        accounts = {name: team.client_env(name, pw) for name, pw in (("admin", ADMIN), ("alice", ALICE), ("bob", BOB))}
        for name, right, pw in (("alice", "EDIT", ALICE), ("bob", "READ", BOB)):  # the doc's commands
            assert f"account {name} made: {right}" in TEAM.team_user(accounts["admin"], name, pw, "team", right)
        yield SimpleNamespace(base=team.base, artifacts=team.artifacts, cert=team.cert, anonymous=team.client_env(),
                              team=team, **accounts)
    finally:
        team.stop()


@contextlib.contextmanager
def _as_admin(server):
    """This process's MLflow client acting as the server's admin, until the block ends."""
    with pytest.MonkeyPatch.context() as admin:
        for name in TRACKING:
            admin.setenv(name, server.admin[name])
        yield admin


def _account(server, name: str, password: str, experiment: str, right: str = "EDIT") -> dict:
    """`ampbench team-user NAME --permission RIGHT --experiment EXPERIMENT` as the admin, in this process (the
    password on standard input); the account's environment."""
    import argparse
    import io

    from ampbench.tracking.server import team_user
    with _as_admin(server) as admin:
        admin.setattr(sys, "stdin", io.StringIO(password + "\n"))
        team_user(argparse.Namespace(name=name, permission=right, experiment=experiment, new_password=False))
    return server.team.client_env(name, password)


def _cli(*args: str, env: dict, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampbench.cli", *args], env=env, input=stdin, capture_output=True,
                          text=True, timeout=300)


MACHINES = {"a": {"cpu_model": "Team machine A (test)", "driver": "580.65.06"},
            "b": {"cpu_model": "Team machine B (test)", "driver": "575.51.03"}}


@pytest.mark.slow
def test_a_team_logs_to_an_authenticated_tls_server_with_one_account_each_and_compares(server, postgres, tmp_path,
                                                                                      capsys):
    """Two machines (two clones presenting two machines) log over TLS: alice's account (EDIT) logs every run; bob's
    (READ) trains, keeps its results and names the right it lacks, then logs them with `ampbench mlflow-sync` once
    the admin granted EDIT; `ampbench compare` sets them side by side. Anonymous, the server is refused in one
    line; no command line holds a password while the server and the stages run; no report holds one."""
    import threading

    from tests.conftest import SHRINK
    params = sandbox.merge(copy.deepcopy(yaml.safe_load((REPO_ROOT / "params.yaml").read_text())), SHRINK)
    params = sandbox.merge(params, {"data": {"train_size": 64, "test_size": 32}, "amp": {"audit_batches": 0},
                                    "profile": {"steps": 0}, "sweep": {"enabled": False},
                                    "mlflow": {"experiment": "team", "log_model": False}})
    params["variants"] = {"fp32": {"precision": "fp32"}, "bf16": {"precision": "bf16"}}
    anonymous = _cli("compare", "--experiment", "team", env=server.anonymous)
    assert anonymous.returncode == 2 and anonymous.stderr.strip().splitlines() == [
        f"error: MLflow tracking server {server.base}: the server wants credentials: set MLFLOW_TRACKING_USERNAME "
        "and MLFLOW_TRACKING_PASSWORD (your account on it)"], anonymous.stderr
    seen, running = [], threading.Event()

    def watch():  # what `ps` shows while the server and a stage run
        while not running.wait(0.3):
            seen.extend(_passwords_in_command_lines())
    watcher = threading.Thread(target=watch)
    watcher.start()
    repos = {}
    try:
        for (name, machine), account in zip(MACHINES.items(), (server.alice, server.bob), strict=True):
            repos[name] = repo = sandbox.create(tmp_path / name, params)
            proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, capture_output=True, text=True,
                                  env={**account, "AMPBENCH_PROBE_OVERRIDE": json.dumps(machine)}, timeout=600)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            assert (repo / "reports" / "runs" / "bf16" / "metrics.json").is_file()  # kept on disk either way
            out = proc.stdout + proc.stderr
            if name == "a":
                assert "MLflow: logged train@bf16" in out and "warning: MLflow" not in out, out[-3000:]
            else:  # READ: env_check says so before training, each log names the missing right
                assert "this account (bob) has READ and may not write to experiment 'team'" in out, out[-3000:]
                assert ("warning: MLflow logging of train@bf16 failed (this account (bob) may not write to "
                        "experiment 'team': ask the server's admin for EDIT") in out, out[-3000:]
    finally:
        running.set()
        watcher.join()
    assert not seen, seen
    assert list(server.artifacts.rglob("metrics.json"))  # artifacts went through the server, to its folder

    _account(server, "bob", BOB, "team")  # `ampbench team-user bob --permission EDIT`, in this process
    assert "account bob existed: EDIT" in capsys.readouterr().out
    synced = subprocess.run([sys.executable, "-m", "ampbench.cli", "mlflow-sync"], cwd=repos["b"], env=server.bob,
                            capture_output=True, text=True, timeout=300)
    assert synced.returncode == 0 and "MLflow: logged train@bf16" in synced.stdout, synced.stdout + synced.stderr
    assert "MLflow: logged the ratios on the training runs" in synced.stdout

    out = tmp_path / "compare"
    proc = subprocess.run([sys.executable, "-m", "ampbench.cli", "compare", "--experiment", "team", "--out",
                           str(out)], cwd=repos["a"], env=server.bob, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    page = out.with_suffix(".md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| Team machine")]
    assert len(rows) == 2 and "580.65.06" in rows[0] and "575.51.03" in rows[1], page
    assert all(" bf16 |" in page and "x (" in row for row in rows)  # a speedup with its interval per machine
    assert out.with_suffix(".png").is_file()
    # a report made with a database URI holding its password in the environment (a machine writing directly)
    direct = subprocess.run([sys.executable, "-m", "dvc", "repro", "--force", "--single-item", "report"],
                            cwd=repos["a"], env={**server.anonymous, "MLFLOW_TRACKING_URI": postgres.uri},
                            capture_output=True, text=True, timeout=300)
    assert direct.returncode == 0 and "report (run " in direct.stdout, direct.stdout + direct.stderr  # one store
    assert PASSWORD not in direct.stdout + direct.stderr
    for repo in repos.values():  # report.md, summary.json, the runs' files: no password anywhere
        for f in (repo / "reports").rglob("*"):
            if f.is_file():
                assert not [x for x in SECRETS if x.encode() in f.read_bytes()], f


@pytest.mark.slow
def test_the_checks_name_a_certificate_this_machine_does_not_trust(server, monkeypatch):
    from ampbench import env
    for name in ("MLFLOW_TRACKING_SERVER_CERT_PATH", "MLFLOW_TRACKING_INSECURE_TLS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ALICE)
    assert "set MLFLOW_TRACKING_SERVER_CERT_PATH to the CA certificate" in env.check_tracking_server(server.base)
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(server.cert))
    assert env.check_tracking_server(server.base, experiment="team") is None
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-" + ALICE)
    assert env.check_tracking_server(server.base) == ("the server refused the credentials of "
                                                      "MLFLOW_TRACKING_USERNAME=alice: check MLFLOW_TRACKING_PASSWORD")


@pytest.mark.slow
def test_a_database_that_is_down_or_refuses_us_fails_fast_without_printing_its_password(server, postgres, tmp_path,
                                                                                       monkeypatch):
    from ampbench import env
    base = server.base
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(server.cert))
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ALICE)
    assert env.check_tracking_server(base) is None and env.check_tracking_server(postgres.uri) is None
    wrong = postgres.uri.replace(PASSWORD, "not-the-password")
    problem = env.check_tracking_server(wrong)
    assert problem and "password authentication failed" in problem and "not-the-password" not in problem
    from ampbench.tracking.server import database_problem  # what `ampbench team-server` asks before it starts
    assert database_problem(postgres.uri) is None and "~/.pgpass" in database_problem(wrong)
    assert "not-the-password" not in database_problem(wrong)
    assert "create it (`createdb nothere`" in database_problem(postgres.uri.replace("/mlflow", "/nothere"))
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
    t0 = time.monotonic()  # a server started while its database is down: one line naming it and the fix, at once
    down = _cli("team-server", "--artifacts", str(tmp_path / "artifacts"), "--host", "127.0.0.1", "--port",
                str(TEAM.free_port()), "--no-tls", env={**sandbox.env_with_venv(), "MLFLOW_BACKEND_STORE_URI":
                                                        postgres.uri, "AMPBENCH_AUTH_DATABASE_URI": postgres.auth_uri,
                                                        "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN})
    took = time.monotonic() - t0
    postgres.start()  # back, for the server and the tests after this one
    [line] = down.stderr.strip().splitlines()
    assert down.returncode == 2 and not down.stdout and took < 30, (took, down.stdout, down.stderr)
    assert line.startswith(f"error: the tracking database postgresql://postgres:***@127.0.0.1:{postgres.port}/mlflow "
                           "(MLFLOW_BACKEND_STORE_URI) does not take a connection: ") and "Connection refused" in line
    assert line.endswith("start it, or point the URI at the database that runs; the server was not started")
    assert PASSWORD not in line and ADMIN not in line


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One machine's results, made in this process: two variants of the small CNN, no model, no report."""
    return TEAM.quick_results(tmp_path_factory.mktemp("made"))


@pytest.mark.slow
def test_three_machines_log_at_once_through_a_server_restart_and_the_replay_leaves_each_run_once(server, postgres,
                                                                                                 made, tmp_path):
    """The load benchmark's smallest round: 3 machines, each with its account, sync at once; the server is stopped
    with SIGTERM mid-log and started again. Each failure is said in one line naming the cause; the replay logs
    the rest; the store holds each run whole exactly once, nothing partial."""
    accounts = [(f"load-{k}", f"load-pw-team-{k}") for k in (1, 2, 3)]
    for name, pw in accounts:
        _account(server, name, pw, "load")
    with _as_admin(server):  # the census reads as the admin
        r = LOAD.load_round(3, server.team, postgres, made, tmp_path, accounts, "load", restart_db=False, twin=False)
    assert r["faults"][0]["writers_running"] >= 1, r["faults"]  # the restart came while they wrote
    assert (r["expected"], r["whole_once"], r["duplicates"], r["partial"], r["retired_finished"]) == (6, 6, 0, 0, 0), r
    first, replay = r["first_sync"], r["replay"]
    assert set(first["exit_codes"]) <= {0, 1} and replay["exit_codes"] == [0, 0, 0], r
    assert first["logged_new"] + replay["logged_new"] == 6 and replay["failed"] == 0, r
    said = (r"the server (did not answer \(connection refused after \d+ retries\): is it running\?|closed the "
            r"connection mid-request after \d+ retries \(it stopped or restarted\?\)|closed the connection while "
            r"storing [\w.]+ after \d+ retries: did it stop, or is its artifact disk full or not writable\? its log "
            r"says which)$")
    assert all(re.match(said, why) for why in first["causes"]), first["causes"]
    assert sum(first["causes"].values()) == first["failed"], first["causes"]


@pytest.mark.slow
def test_a_full_artifact_disk_fails_the_log_in_one_line_and_the_replay_completes_once_there_is_room(server, made,
                                                                                                 tmp_path):
    """The server's artifact folder for the experiment a 4 KiB tmpfs: each run's upload fails, the sync says why
    in one line (no traceback) and keeps the results on disk; with room again, the replay logs each run once."""
    if os.geteuid() != 0:
        pytest.skip("a full disk is a 4 KiB tmpfs here, and mounting one needs root (CI runs as root)")
    env = {**_account(server, "carol", "carol-pw-team-1", "full"), "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0"}
    with _as_admin(server):
        from mlflow.tracking import MlflowClient
        client = MlflowClient(server.base)
        disk = server.artifacts / client.get_experiment_by_name("full").experiment_id
        disk.mkdir(parents=True, exist_ok=True)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "ampbench-full", str(disk)],
                                 capture_output=True, text=True)
        if mounted.returncode:
            pytest.skip(f"could not mount a tmpfs: {mounted.stderr.strip()}")
        try:
            keys = LOAD.as_machine(made, tmp_path / "m", "Full machine (test)", "full")
            full = subprocess.run([sys.executable, "-m", "ampbench.cli", "mlflow-sync"], cwd=tmp_path / "m", env=env,
                                  capture_output=True, text=True, timeout=300)
            pending = list((tmp_path / "m" / ".ampbench" / "mlflow-pending").glob("train@*"))  # kept, for the replay
            subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # room again
            replay = subprocess.run([sys.executable, "-m", "ampbench.cli", "mlflow-sync"], cwd=tmp_path / "m",
                                    env=env, capture_output=True, text=True, timeout=300)
            found = LOAD.census(client, "full", {"Full machine (test)": keys})
        finally:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    warnings = [line for line in full.stdout.splitlines() if line.startswith("warning:")]
    assert full.returncode == 1 and len(warnings) == 2 and "Traceback" not in full.stdout + full.stderr, full.stdout
    said = (r"warning: MLflow logging of train@\w+ failed \(the server (could not store [\w.]+ \(HTTP 500 after \d+ "
            r"retries\):|closed the connection while storing [\w.]+ after \d+ retries: did it stop, or) is its "
            r"artifact disk full or not writable\? its log says which\); the results are on disk")  # 500, or cut
    assert all(re.match(said, w) for w in warnings), warnings
    assert len(pending) == 2 and (tmp_path / "m" / "reports" / "runs" / "fp32" / "metrics.json").is_file()
    assert replay.returncode == 0 and replay.stdout.count("MLflow: logged train@") == 2, replay.stdout
    assert (found["expected"], found["whole_once"], found["duplicates"], found["partial"]) == (2, 2, 0, 0), found
