"""MLflow servers ampbench starts: the UI on one repository's store (``ampbench mlflow-ui``) and a team's server
(``ampbench team-server``: MLflow's basic-auth app over TLS), and a team's accounts (``ampbench team-user``).

No secret goes on a command line, where every local user reads it (``ps``, ``/proc/<pid>/cmdline``) and shells
keep it: the tracking database's URI goes to MLflow in ``MLFLOW_BACKEND_STORE_URI``, the auth database's in an ini
file only this user can read (MLflow's basic-auth reads it from nowhere else), the admin's first password in
``MLFLOW_AUTH_ADMIN_PASSWORD``, an account's password on standard input.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ampbench.config import one_line, redact, redact_text
from ampbench.errors import ConfigError, stop_with_parent

STORE_ENV = "MLFLOW_BACKEND_STORE_URI"  # MLflow's own: `mlflow server` reads its --backend-store-uri from it
AUTH_DB_ENV = "AMPBENCH_AUTH_DATABASE_URI"  # the basic-auth app's users and permissions, a database of its own
PERMISSIONS = ("NO_PERMISSIONS", "READ", "EDIT", "MANAGE")
GRACE_S = 3  # uvicorn's wait for open connections at a stop; without a limit it waits for keep-alive clients
GRACE_OPTS = f"--timeout-graceful-shutdown {GRACE_S}"  # the --uvicorn-opts both servers start with
LISTEN_ALL = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # an address that listens on every interface, and its loopback


def url_host(host: str) -> str:
    """``host`` as a URL writes it: an IPv6 literal in brackets (``http://[::1]:5000``; ``http://::1:5000`` is no
    URL)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def base_urls(scheme: str, host: str, port: int) -> tuple[str, str]:
    """The server's URL as told to users, and the one this machine probes (its loopback where it listens on
    every interface)."""
    return (f"{scheme}://{url_host(host)}:{port}", f"{scheme}://{url_host(LISTEN_ALL.get(host, host))}:{port}")


def run(cmd: list[str], env: dict[str, str], probe: str, wait_s: float, what: str, ready: str) -> None:
    """Start a server (its own session; SIGTERM to it if this process dies, even by SIGKILL), print ``ready`` once
    ``probe``'s /health answers, and stop its whole process tree on Ctrl-C, SIGTERM (a process manager) or SIGHUP
    (the terminal closed)."""
    server = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=stop_with_parent)
    stop = _stopper(server, what)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        if not _wait_until_up(server, probe, wait_s):
            code = server.poll()
            raise ConfigError(f"the {what} did not start on {probe} ("
                              + (f"it exited with status {code}; its reason is above: a port in use? try --port"
                                 if code is not None else f"no answer within {wait_s:g} s") + ")")
        print(ready, flush=True)
        server.wait()
    finally:
        stop()


def _wait_until_up(server: subprocess.Popen, base: str, timeout: float) -> bool:
    """Poll the server's /health until it answers; False if it exits first or does not answer in time. (Liveness
    only: over TLS the certificate is not checked here, the clients check it.)"""
    import requests
    import urllib3
    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return False
        with contextlib.suppress(requests.RequestException):
            if requests.get(base + "/health", timeout=2, verify=False).status_code == 200:
                return True
        time.sleep(0.5)
    return False


def _stopper(server: subprocess.Popen, what: str):
    """A signal handler (and a plain call) that stops the server's whole process tree, then exits."""
    def stop(signum=None, frame=None):
        import psutil
        try:
            family = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        for proc in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        _, alive = psutil.wait_procs(family, timeout=10)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        if signum is not None:
            print(f"{what} stopped", flush=True)
            sys.exit(0)
    return stop


def auth_ini(folder: Path, database_uri: str, default_permission: str, cache_s: int = 60) -> Path:
    """The basic-auth app's settings, in a file only this user can read (the auth database's URI may hold its
    password): every account's right where none was granted is ``default_permission``; the admin account is
    ``admin``, its first password from MLFLOW_AUTH_ADMIN_PASSWORD. A password checked is trusted for ``cache_s``
    seconds in each worker: MLflow hashes it with scrypt on every request otherwise (a run's log makes about a
    hundred), and a changed password or a deleted account takes that long to reach the other workers."""
    if "\n" in database_uri or "\r" in database_uri:
        raise ConfigError(f"{AUTH_DB_ENV} holds a line break; give the database's URI on one line")
    path = Path(folder) / "basic_auth.ini"
    text = ("[mlflow]\n"
            f"default_permission = {default_permission}\n"
            f"database_uri = {database_uri.replace('%', '%%')}\n"  # configparser: a password's %40 stays %40
            "admin_username = admin\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            f"auth_cache_ttl_seconds = {int(cache_s)}\n")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


SERVER_DATABASES = ("postgresql", "mysql", "mssql")  # a store reached over the network (not a SQLite file)


def database_problem(uri: str, timeout: float = 5) -> str | None:
    """Why the database at ``uri`` takes no connection, and the fix, in words; None where it takes one (or is a
    SQLite file). Asked before MLflow's server starts: MLflow retries for about 100 s, then prints a traceback."""
    if uri.split(":", 1)[0].split("+", 1)[0] not in SERVER_DATABASES:
        return None
    import sqlalchemy  # MLflow's own dependency: its database store is SQLAlchemy's
    try:
        engine = sqlalchemy.create_engine(uri, connect_args={"connect_timeout": int(max(1, timeout))})
        try:
            with engine.connect():
                return None
        finally:
            engine.dispose()
    except Exception as err:  # a missing driver, a refused connection, a bad password: one line either way
        lines = str(getattr(err, "orig", None) or err).strip().splitlines() or [type(err).__name__]
        why = redact_text(one_line(lines[0]))
    if "does not exist" in why:
        fix = f"create it (`createdb {uri.rsplit('/', 1)[-1].split('?')[0]}` as a PostgreSQL user that may)"
    elif "password authentication failed" in why or "Access denied" in why:
        fix = "put this user's password for it in ~/.pgpass (mode 0600), or in the URI"
    else:
        fix = "start it, or point the URI at the database that runs"
    return f"{why}: {fix}"


def team_server(args) -> None:
    """The team's tracking server: MLflow's basic-auth app (an account per person or machine, rights per
    experiment), TLS through uvicorn, artifacts served, the databases' URIs from the environment."""
    from ampbench import tracking
    store, auth_db = os.environ.get(STORE_ENV, ""), os.environ.get(AUTH_DB_ENV, "")
    if not store:
        raise ConfigError(f"set {STORE_ENV} to the tracking database, e.g. postgresql://mlflow@db-host:5432/mlflow "
                          "(its password in ~/.pgpass, or in this variable; never on a command line)")
    if not auth_db:
        raise ConfigError(f"set {AUTH_DB_ENV} to the database of accounts and rights, e.g. "
                          "postgresql://mlflow@db-host:5432/mlflow_auth (a database of its own; its password in "
                          "~/.pgpass or in this variable)")
    if args.default_permission not in ("NO_PERMISSIONS", "READ"):
        raise ConfigError(f"--default-permission {args.default_permission}: give NO_PERMISSIONS (an account sees "
                          "only the experiments it was granted) or READ (every account reads every experiment)")
    tls = [args.tls_cert, args.tls_key]
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    if args.no_tls and any(tls):
        raise ConfigError("--no-tls with --tls-cert or --tls-key: give the certificate and key, or --no-tls alone")
    if not all(tls) and not args.no_tls:
        raise ConfigError("give --tls-cert and --tls-key (PEM files: passwords cross the network in every request), "
                          "or --no-tls --host 127.0.0.1 where a reverse proxy on this machine serves TLS")
    if args.no_tls and not loopback:
        raise ConfigError(f"--no-tls on --host {args.host} would send every password in clear over the network: "
                          "with --no-tls, serve on --host 127.0.0.1 behind the reverse proxy that serves TLS")
    if not loopback and not args.allowed_hosts:
        raise ConfigError(f"--host {args.host} needs --allowed-hosts NAME:PORT, the names clients reach this server "
                          "by (MLflow refuses any other Host header: its guard against DNS rebinding)")
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path and not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")
    for what, var, uri in (("tracking database", STORE_ENV, store), ("database of accounts", AUTH_DB_ENV, auth_db)):
        problem = database_problem(uri)
        if problem:
            raise ConfigError(f"the {what} {redact(uri)} ({var}) does not take a connection: {problem}; the server "
                              "was not started")
    Path(args.artifacts).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ampbench-auth-") as private:  # 0700
        env = {**{k: v for k, v in tracking.server_env().items() if k != AUTH_DB_ENV}, STORE_ENV: store,
               "MLFLOW_AUTH_CONFIG_PATH": str(auth_ini(Path(private), auth_db, args.default_permission,
                                                         args.auth_cache_s)),
               # CSRF tokens for the UI's forms: a key per start unless the team sets one (several servers)
               "MLFLOW_FLASK_SERVER_SECRET_KEY": os.environ.get("MLFLOW_FLASK_SERVER_SECRET_KEY")
               or secrets.token_hex(32)}
        cmd = [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth", "--serve-artifacts",
               "--artifacts-destination", str(Path(args.artifacts).resolve()), "--host", args.host, "--port",
               str(args.port), "--workers", str(args.workers)]
        if args.allowed_hosts:
            cmd += ["--allowed-hosts", args.allowed_hosts]
        # a stop waits at most GRACE_S for clients' open connections (keep-alive ones never close on their own)
        opts = GRACE_OPTS
        if all(tls):
            opts += (f" --ssl-certfile {shlex.quote(str(Path(args.tls_cert).resolve()))}"
                     f" --ssl-keyfile {shlex.quote(str(Path(args.tls_key).resolve()))}")
        cmd += ["--uvicorn-opts", opts]
        scheme = "https" if all(tls) else "http"
        told, local = base_urls(scheme, args.host, args.port)
        print(f"MLflow team server on {told}: basic-auth (accounts' default right "
              f"{args.default_permission}){', TLS' if all(tls) else ''}, tracking database {redact(store)}; "
              "starting ...", flush=True)
        run(cmd, env, local, args.wait, "MLflow team server",
            f"serving {told}: add an account per person or machine with `ampbench "
            "team-user NAME`; each machine sets MLFLOW_TRACKING_URI, MLFLOW_TRACKING_USERNAME, "
            "MLFLOW_TRACKING_PASSWORD" + (" and MLFLOW_TRACKING_SERVER_CERT_PATH (the CA that signed --tls-cert)"
                                          if all(tls) else "") + "\n  Ctrl-C stops it")


def team_user(args) -> None:
    """An account on the team's server, and its right on the experiment (made if need be): run by the admin
    (MLFLOW_TRACKING_USERNAME=admin); a new account's password read from standard input, never argv. For an
    account that exists, the right alone changes (its password too with --new-password)."""
    import warnings

    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from ampbench import config, tracking
    from ampbench.tracking import access
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")):
        raise ConfigError("set MLFLOW_TRACKING_URI to the team's server (https://tracking-host:5000), and "
                          "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD to its admin account")
    if args.permission not in PERMISSIONS:
        raise ConfigError(f"--permission {args.permission}: give one of {', '.join(PERMISSIONS)} (EDIT logs runs)")
    with warnings.catch_warnings():  # the server's modules, imported for their client: their deprecations
        warnings.simplefilter("ignore")
        from mlflow.server import get_app_client
        auth = get_app_client("basic-auth", tracking_uri=uri)
    try:
        exists = _account_exists(auth, args.name)
        if not exists or args.new_password:
            password = _read_password(args.name)
            if exists:
                auth.update_user_password(args.name, password)
            else:
                auth.create_user(args.name, password)
        made = "existed" + ("; its password replaced" if args.new_password else "") if exists else "made"
        client = MlflowClient(uri)
        exp_id = tracking._experiment_id(client, config.MlflowConfig(experiment=args.experiment), uri, Path.cwd())
        try:
            auth.grant_user_permission(args.name, "experiment", exp_id, args.permission)
        except MlflowException as err:  # a right granted before: replaced
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            auth.revoke_user_permission(args.name, "experiment", exp_id)
            auth.grant_user_permission(args.name, "experiment", exp_id, args.permission)
    except MlflowException as err:
        why = ("only the server's admin adds accounts and grants rights: set MLFLOW_TRACKING_USERNAME=admin and "
               "MLFLOW_TRACKING_PASSWORD to its password") if access.status(err) == 403 else \
            access.describe(err, args.experiment)
        raise ConfigError(f"{redact(uri)}: {why}") from None
    print(f"account {args.name} {made}: {args.permission} on experiment {args.experiment!r} (id {exp_id}). On its "
          f"machine: export MLFLOW_TRACKING_URI={redact(uri)} MLFLOW_TRACKING_USERNAME={args.name} and "
          "MLFLOW_TRACKING_PASSWORD (in a file only that user reads, e.g. sourced from ~/.config)")


def _account_exists(auth, name: str) -> bool:
    from mlflow.exceptions import MlflowException
    try:
        auth.get_user(name)
        return True
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        return False


def _read_password(name: str) -> str:
    """An account's password: typed twice at a terminal, else one line of standard input; never argv."""
    import getpass
    if sys.stdin.isatty():
        password = getpass.getpass(f"password for {name}: ")
        if getpass.getpass("again: ") != password:
            raise ConfigError("the two passwords differ; nothing was changed")
    else:
        password = sys.stdin.readline().rstrip("\n")
    if len(password) < 12:
        raise ConfigError(f"the password for {name} has {len(password)} characters: give at least 12 (on standard "
                          "input, never on the command line)")
    return password


def add_parsers(sub) -> None:
    t = sub.add_parser("team-server", help="the team's MLflow server: accounts and rights (basic-auth), TLS; the "
                                           "databases from MLFLOW_BACKEND_STORE_URI and AMPBENCH_AUTH_DATABASE_URI")
    t.add_argument("--artifacts", required=True, help="the folder the server keeps every run's files in")
    t.add_argument("--host", default="0.0.0.0", help="the address to listen on (default: every interface)")
    t.add_argument("--port", type=int, default=5000)
    t.add_argument("--allowed-hosts", default="", help="host:port names clients reach it by (MLflow's DNS-rebinding "
                                                       "guard), e.g. tracking-host:5000")
    t.add_argument("--workers", type=int, default=4)
    t.add_argument("--tls-cert", default="", help="the server's certificate (PEM)")
    t.add_argument("--tls-key", default="", help="its private key (PEM, readable by this user only)")
    t.add_argument("--no-tls", action="store_true", help="plain HTTP, for a reverse proxy in front that serves TLS")
    t.add_argument("--default-permission", default="NO_PERMISSIONS",
                   help="an account's right on an experiment it was granted nothing on: NO_PERMISSIONS or READ")
    t.add_argument("--auth-cache-s", type=int, default=60, metavar="S",
                   help="trust a checked password for S seconds in each worker (default 60; 0: hash it on every "
                        "request, each a fraction of a second of CPU); a changed password takes that long to apply")
    t.add_argument("--wait", type=float, default=180, help="seconds to wait for the server to answer")
    u = sub.add_parser("team-user", help="add an account to the team's server (its password on standard input) "
                                         "and grant it a right on the experiment")
    u.add_argument("name")
    u.add_argument("--permission", default="EDIT", help="EDIT (logs runs; the default), READ, MANAGE or "
                                                        "NO_PERMISSIONS")
    u.add_argument("--experiment", default="ampbench")
    u.add_argument("--new-password", action="store_true", help="replace an existing account's password (read from "
                                                               "standard input); a new account always gets one")
