"""A team: `ampbench team-server` (MLflow's basic-auth app over TLS) backed by a real PostgreSQL, serving artifacts,
an account per machine, two machines (two clones that present different machines) running the pipeline into it
over https://, and `ampbench compare` putting them side by side; the refusals (no credentials, a missing right, a
certificate not trusted) each said in one line, and no password in a command line or a report.

PostgreSQL comes from Debian's `postgresql` package (`make test` installs it where it can); without it this test
skips with its reason, except under CI=true, where it fails.
"""

from __future__ import annotations

import contextlib
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
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from ampbench import sandbox
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
        for db in ("mlflow", "mlflow_auth"):  # the runs; the accounts and their rights (basic-auth's own)
            subprocess.run([str(pg / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", db],
                           check=True, capture_output=True, env=env, timeout=60)
        yield SimpleNamespace(uri=f"postgresql://postgres:{PASSWORD}@127.0.0.1:{port}/mlflow", port=port,
                              auth_uri=f"postgresql://postgres:{PASSWORD}@127.0.0.1:{port}/mlflow_auth",
                              stop=lambda: subprocess.run(_as_postgres([str(pg / "pg_ctl"), "-D", str(data), "-m",
                                                                        "fast", "stop"]), capture_output=True,
                                                          timeout=120))
    finally:
        subprocess.run(_as_postgres([str(pg / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"]),
                       capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


ADMIN, ALICE, BOB = "admin-pw-team-1", "alice-pw-team-1", "bob-pw-team-12"  # every password the test gives
SECRETS = (PASSWORD, ADMIN, ALICE, BOB)


def _certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA), and its key: the test's private CA."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    (folder / "key.pem").chmod(0o600)
    return folder / "cert.pem", folder / "key.pem"


def _cli(*args: str, env: dict, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampbench.cli", *args], env=env, input=stdin, capture_output=True,
                          text=True, timeout=300)


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
    with READ. (its https:// URI, the artifacts' folder, the CA's file, an environment per account)"""
    folder = tmp_path_factory.mktemp("server")
    cert, key = _certificate(folder)
    port = _free_port()
    artifacts = folder / "artifacts"
    log = (folder / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "ampbench.cli", "team-server", "--artifacts", str(artifacts),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--tls-cert", str(cert),
                             "--tls-key", str(key)],
                            env={**sandbox.env_with_venv(), "MLFLOW_BACKEND_STORE_URI": postgres.uri,
                                 "AMPBENCH_AUTH_DATABASE_URI": postgres.auth_uri,
                                 "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"https://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while "serving https://" not in (folder / "server.log").read_text():
            assert proc.poll() is None and time.time() < deadline, (folder / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        assert not _passwords_in_command_lines()  # the server's processes, started
        client = {**sandbox.env_with_venv(), "MLFLOW_TRACKING_URI": base, "MLFLOW_TRACKING_SERVER_CERT_PATH": str(cert)}
        accounts = {name: {**client, "MLFLOW_TRACKING_USERNAME": name, "MLFLOW_TRACKING_PASSWORD": pw}
                    for name, pw in (("admin", ADMIN), ("alice", ALICE), ("bob", BOB))}
        for name, right, pw in (("alice", "EDIT", ALICE), ("bob", "READ", BOB)):  # the doc's commands
            made = _cli("team-user", name, "--permission", right, "--experiment", "team", env=accounts["admin"],
                        stdin=pw + "\n")
            assert made.returncode == 0 and f"account {name} made: {right}" in made.stdout, made.stderr[-2000:]
        yield SimpleNamespace(base=base, artifacts=artifacts, cert=cert, anonymous=client, **accounts)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
        log.close()


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

    with pytest.MonkeyPatch.context() as admin:  # `ampbench team-user bob --permission EDIT`, in this process
        import argparse

        from ampbench.tracking.server import team_user
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_SERVER_CERT_PATH", "MLFLOW_TRACKING_USERNAME",
                     "MLFLOW_TRACKING_PASSWORD"):
            admin.setenv(name, server.admin[name])
        team_user(argparse.Namespace(name="bob", permission="EDIT", experiment="team", new_password=False))
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
