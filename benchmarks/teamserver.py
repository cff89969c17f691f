"""A throwaway team for the load benchmark and the team tests: a PostgreSQL cluster (Debian's postgresql, as `make
test` installs it), a certificate of its own CA, `ampbench team-server` over TLS that can be stopped with SIGTERM and
started again, and accounts made with `ampbench team-user`."""

from __future__ import annotations

import datetime
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PG_BINS = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_postgres(cmd: list[str]) -> list[str]:
    """initdb and postgres refuse to run as root: as root (CI), they run as the postgres user."""
    return cmd if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--", *cmd]


class Cluster:
    """A throwaway PostgreSQL cluster on a loopback port, a password for its superuser, and two databases: the
    runs (``uri``) and basic-auth's accounts (``auth_uri``)."""

    def __init__(self, password: str):
        self.pg = Path(PG_BINS[-1])
        self.root = Path(tempfile.mkdtemp(prefix="ampbench-pg-"))  # not under a 0700 folder: postgres reaches it
        self.data, sock, pwfile = self.root / "data", self.root / "sock", self.root / "pw"
        sock.mkdir()
        pwfile.write_text(password + "\n")
        if os.geteuid() == 0:
            for p in (self.root, sock, pwfile):
                shutil.chown(p, "postgres")
            self.root.chmod(0o755)
        self.port = free_port()
        self.opts = f"-p {self.port} -k {sock} -c listen_addresses=127.0.0.1"
        self._pg(["initdb", "-D", str(self.data), "-U", "postgres", "--auth=scram-sha-256", f"--pwfile={pwfile}",
                  "-E", "UTF8", "--no-locale"])
        self.start()
        try:
            for db in ("mlflow", "mlflow_auth"):
                subprocess.run([str(self.pg / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                                db], check=True, capture_output=True, env={**os.environ, "PGPASSWORD": password},
                               timeout=60)
        except BaseException:
            self.close()
            raise
        self.uri = f"postgresql://postgres:{password}@127.0.0.1:{self.port}/mlflow"
        self.auth_uri = self.uri.removesuffix("/mlflow") + "/mlflow_auth"

    def _pg(self, args: list[str], check: bool = True) -> None:
        subprocess.run(as_postgres([str(self.pg / args[0]), *args[1:]]), check=check, capture_output=True,
                       timeout=120)

    def start(self) -> None:
        self._pg(["pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-w", "-o", self.opts, "start"])

    def stop(self) -> None:
        self._pg(["pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop"], check=False)

    def restart(self) -> None:
        self._pg(["pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-m", "fast", "-w", "-o", self.opts,
                  "restart"])

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA), and its key."""
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


class TeamServer:
    """`ampbench team-server` over TLS on ``cluster``, its output (uvicorn's access log too) appended to
    ``folder/server.log``: started, stopped with SIGTERM (as a process manager stops it), started again."""

    def __init__(self, folder: Path, cluster: Cluster, admin_password: str, workers: int = 4):
        self.folder, self.workers = folder, workers
        self.cert, self.key = certificate(folder)
        self.port, self.artifacts, self.log = free_port(), folder / "artifacts", folder / "server.log"
        self.base = f"https://127.0.0.1:{self.port}"
        self.env = {**_venv_env(), "MLFLOW_BACKEND_STORE_URI": cluster.uri,
                    "AMPBENCH_AUTH_DATABASE_URI": cluster.auth_uri, "MLFLOW_AUTH_ADMIN_PASSWORD": admin_password}
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout: float = 180) -> float:
        """Start it; the seconds until it said it serves."""
        t0, offset = time.monotonic(), self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ampbench.cli", "team-server", "--artifacts", str(self.artifacts), "--host",
                 "127.0.0.1", "--port", str(self.port), "--workers", str(self.workers), "--tls-cert", str(self.cert),
                 "--tls-key", str(self.key)], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        while b"serving https://" not in self.log.read_bytes()[offset:]:
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError("team-server did not start: " + self.log.read_text(errors="replace")[-3000:])
            time.sleep(0.2)
        return time.monotonic() - t0

    def stop(self) -> None:
        """SIGTERM to ampbench's process, which stops the server's whole process tree and exits."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)

    def rss(self) -> int:
        """The resident memory of the server's process tree, in bytes."""
        import psutil
        try:
            root = psutil.Process(self.proc.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except (psutil.Error, AttributeError):
            return 0

    def client_env(self, user: str = "", password: str = "") -> dict[str, str]:
        """A machine's environment for this server: its address, its CA, an account (none: anonymous)."""
        account = {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password} if user else {}
        return {**_venv_env(), "MLFLOW_TRACKING_URI": self.base, "MLFLOW_TRACKING_SERVER_CERT_PATH": str(self.cert),
                **account}


def _venv_env() -> dict[str, str]:
    """This environment, this interpreter's folder first on PATH, and no tracking settings of the caller's."""
    from ampbench import sandbox
    return {k: v for k, v in sandbox.env_with_venv().items() if not k.startswith("MLFLOW_TRACKING")}


def team_user(env: dict, name: str, password: str, experiment: str, right: str = "EDIT") -> str:
    """`ampbench team-user NAME` as the admin (``env``), the password on standard input; what it printed."""
    made = subprocess.run([sys.executable, "-m", "ampbench.cli", "team-user", name, "--permission", right,
                           "--experiment", experiment], env=env, input=password + "\n", capture_output=True,
                          text=True, timeout=300)
    if made.returncode != 0 or f"account {name} " not in made.stdout:
        raise RuntimeError(f"team-user {name}: {made.stdout[-1000:]}{made.stderr[-2000:]}")
    return made.stdout


# params.yaml shrunk to a small CNN, 64 synthetic images and one CPU epoch: a machine's results in seconds
SMALL = {"device": "cpu", "data": {"source": "synthetic", "train_size": 64, "test_size": 32},
         "model": {"arch": "small_cnn", "input_size": 16}, "amp": {"audit_batches": 0}, "profile": {"steps": 0},
         "train": {"epochs": 1, "batch_size": 32, "warmup_steps": 1, "eval_batch_size": 64},
         "sweep": {"enabled": False}, "paired": {"enabled": False}}


def small_params(**sections) -> dict:
    """The repository's params.yaml, made SMALL, with ``sections`` on top."""
    import copy

    import yaml

    from ampbench import sandbox
    params = copy.deepcopy(yaml.safe_load((Path(sandbox.REPO_ROOT) / "params.yaml").read_text()))
    return sandbox.merge(sandbox.merge(params, SMALL), sections)


def quick_results(folder: Path, variants: tuple[str, ...] = ("fp32", "bf16"), cpu: str = "Team machine (test)") -> Path:
    """A machine's results made in this process (what `dvc repro` writes, in seconds): each variant's run folder
    and plan, the machine's env.json (its CPU ``cpu``, named in each metrics.json too) and params.yaml; no model,
    no report. The load benchmark makes its own with `dvc repro` (``load.results_folder``)."""
    import json

    import yaml

    from ampbench import config, data, results, runplan
    from ampbench.train import runner
    params = small_params(mlflow={"log_model": False})
    params["variants"] = {v: {"precision": v} for v in variants}
    cfg = config.from_dict(params)
    meta = data.prepare(cfg.data, 0, folder / "prepared", folder / "raw")
    prepared = data.load_prepared(folder / "prepared", "cpu")
    env = {"cpu_model": cpu, "gpu": None, "torch": "test", "cuda_runtime": None}
    reports = folder / "reports"
    for variant in variants:
        plan = runplan.make_plan(cfg, variant, "cpu")
        result = runner.train(plan, prepared, progress=False, profile=False)
        result.metrics.update(env_fingerprint=results.fingerprint(env), dataset=data.record(folder / "prepared", meta))
        results.write_run(reports / "runs" / variant, result.metrics, result.tables(), result.step_times_ms)
        (reports / "plans").mkdir(parents=True, exist_ok=True)
        (reports / "plans" / f"{variant}.json").write_text(json.dumps(config.to_dict(plan)))
    (reports / "env.json").write_text(json.dumps(env))
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return folder
