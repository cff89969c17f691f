"""What runs beside training: the DVC experiment queue's workers, and the MLflow tracking store a stage
will log to.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil

from ampbench.errors import EnvironmentMismatch, first_line


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
    from ampbench.tracking import access  # MLflow's client, its credentials and TLS settings
    try:
        return access.check_server(uri.rstrip("/"), timeout, experiment)
    except Exception as err:  # an answer MLflow's client cannot read (an empty body, JSON of another shape): said,
        return f"answers what no MLflow server does ({first_line(err)})"  # as the store never stops a stage


def _check_database(uri: str, timeout: float) -> str | None:
    import sqlalchemy  # MLflow's own dependency: the database store is SQLAlchemy's
    try:
        engine = sqlalchemy.create_engine(uri, connect_args={"connect_timeout": int(max(1, timeout))})
        with engine.connect():
            return None
    except Exception as err:  # a missing driver, a refused connection, a bad password: one line either way
        first = (str(getattr(err, "orig", None) or err).strip().splitlines() or [type(err).__name__])[0]
        from ampbench.config import one_line
        return f"could not be reached ({one_line(first)})"
