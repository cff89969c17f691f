"""What runs beside training: the DVC experiment queue's workers, and the MLflow tracking store a stage
will log to.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil

from ampbench.errors import EnvironmentMismatch


def queue_workers(root: Path) -> int:
    """DVC experiment-queue workers running for the repository at ``root`` (``dvc queue start -j N`` starts N):
    each runs one queued experiment at a time, so N > 1 trains several at once on this machine."""
    found = 0
    for info in (Path(root) / ".dvc" / "tmp" / "exps" / "celery").glob("dvc-exp-worker-*.json"):
        try:
            proc = psutil.Process(int(json.loads(info.read_text())["pid"]))
            found += proc.is_running() and "queue-worker" in " ".join(proc.cmdline())
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            continue  # a worker that has exited (its files stay behind)
    return found


def check_queue(root: Path, experiment: str | None) -> None:
    """Stop a queued experiment when other queue workers would train beside it: several trainings on one GPU
    measure each other, and several writers share one SQLite tracking store."""
    workers = queue_workers(root) if experiment else 0
    if workers > 1:
        raise EnvironmentMismatch(
            f"experiment {experiment} runs beside {workers - 1} other DVC queue worker(s) (dvc queue start -j "
            f"{workers}): their trainings would share this machine and time each other; run the queue with one "
            "worker: dvc queue stop, then dvc queue start (and dvc exp run --run-all for the failed ones)")


DATABASES = ("postgresql", "mysql", "mssql")  # tracking stores a client would write to directly (not sqlite)


def check_tracking_server(uri: str, timeout: float = 5.0, experiment: str = "") -> str | None:
    """A problem description if the tracking store cannot take runs, else None: an http(s) server that does not
    answer /health in time, wants credentials or a right this machine lacks, presents a certificate it does not
    trust, or answers but cannot reach its own database (it lists no experiment); a database URI that does not
    connect (bad host, port or password). The description never holds a password.

    A server is asked through MLflow's own HTTP client, so the settings that apply to logging apply here too:
    MLFLOW_TRACKING_USERNAME / PASSWORD / TOKEN, MLFLOW_TRACKING_SERVER_CERT_PATH, MLFLOW_TRACKING_INSECURE_TLS."""
    if uri.split(":", 1)[0].split("+", 1)[0] in DATABASES:
        return _check_database(uri, timeout)
    if not uri.startswith(("http://", "https://")):
        return None
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    from ampbench.tracking import access
    creds = get_default_host_creds(uri.rstrip("/"))

    def get(endpoint: str, **params):
        return http_request(creds, endpoint, "GET", max_retries=0, timeout=timeout, raise_on_status=False,
                            params=params or None)
    try:
        health = get("/health")
        if health.status_code != 200:
            return f"answered HTTP {health.status_code}"
        found = get("/api/2.0/mlflow/experiments/search", max_results=1)
        if found.status_code == 200 and experiment:
            return _right(get, experiment)
    except MlflowException as err:  # refused, timed out, a bad host, a certificate not trusted
        text = str(err)
        if "timed out" in text or "Timeout" in text:
            return f"did not answer within {timeout:g}s"
        return access.cause(err) or _reason(text)
    if found.status_code == 200:
        return None
    return access.for_status(found.status_code) or (
        f"answers, but not for its runs (HTTP {found.status_code}"
        + (f": {_one_line(found.text[:300])}" if found.text else "") + "): is its database up?")


def _right(get, experiment: str) -> str | None:
    """Under MLflow's basic-auth app: whether this account may log to ``experiment`` (EDIT or MANAGE); None where
    it may, where the experiment does not exist yet (the first run makes it), or where the server has no accounts."""
    import os

    from ampbench.tracking import access
    user = os.environ.get("MLFLOW_TRACKING_USERNAME", "")
    exp = get("/api/2.0/mlflow/experiments/get-by-name", experiment_name=experiment)
    if exp.status_code in (401, 403):
        return access.for_status(exp.status_code, experiment)
    if exp.status_code != 200 or not user:
        return None
    exp_id = exp.json()["experiment"]["experiment_id"]
    right = get("/api/3.0/mlflow/users/permissions/get", username=user, resource_type="experiment",
                resource_id=exp_id)
    if right.status_code != 200:  # no basic-auth app: every client may write
        return None
    permission = right.json().get("permission", "")
    if permission in ("EDIT", "MANAGE"):
        return None
    return access.for_status(403, experiment).replace("may not write", f"has {permission or 'no right'} and "
                                                                        "may not write", 1)


def _reason(text: str) -> str:
    """The cause inside requests' "Max retries exceeded ... (Caused by NewConnectionError(...: [Errno 111]
    Connection refused))": its last words."""
    import re
    found = re.findall(r"\[Errno -?\d+\] ([^'\")]+)", text)
    return found[-1].strip() if found else _one_line(text)[:200]


def _one_line(text: str) -> str:
    from ampbench.config import redact_text
    return redact_text(" ".join(text.split()))


def _check_database(uri: str, timeout: float) -> str | None:
    import sqlalchemy  # MLflow's own dependency: the database store is SQLAlchemy's
    try:
        engine = sqlalchemy.create_engine(uri, connect_args={"connect_timeout": int(max(1, timeout))})
        with engine.connect():
            return None
    except Exception as err:  # a missing driver, a refused connection, a bad password: one line either way
        first = (str(getattr(err, "orig", None) or err).strip().splitlines() or [type(err).__name__])[0]
        return f"could not be reached ({_one_line(first)})"
