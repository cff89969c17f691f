"""MLflow tracking: the only module that imports mlflow.

Where runs go: ``$MLFLOW_TRACKING_URI`` if set, else ``mlflow.tracking_uri`` in
params.yaml, else ``sqlite:///<repo>/mlflow.db`` with artifacts in
``<repo>/mlartifacts``. Logging happens after a stage has written its results to
disk, and a failure to log is a warning, never a lost run.
"""

from __future__ import annotations

import os
from pathlib import Path

# Fail fast against an unreachable server instead of minutes of retries (set before mlflow is imported).
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

import mlflow  # noqa: E402
from mlflow.entities import Metric, Param  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from ampbench.config import MlflowConfig, flatten  # noqa: E402


def resolve_uri(cfg: MlflowConfig, repo_root: Path) -> str:
    env = os.environ.get("MLFLOW_TRACKING_URI", "")
    if env:
        return env
    if cfg.tracking_uri:
        return cfg.tracking_uri
    return f"sqlite:///{Path(repo_root).resolve() / 'mlflow.db'}"


def _experiment_id(client: MlflowClient, cfg: MlflowConfig, uri: str, repo_root: Path) -> str:
    exp = client.get_experiment_by_name(cfg.experiment)
    if exp is not None:
        return exp.experiment_id
    artifacts = None
    if uri.startswith("sqlite:///") or uri.startswith("file:") or "://" not in uri:
        artifacts = (Path(repo_root).resolve() / "mlartifacts").as_uri()
    return client.create_experiment(cfg.experiment, artifact_location=artifacts)


def _metric_value(value) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def log_run(cfg: MlflowConfig, repo_root: Path, *, run_name: str, params: dict, metrics: dict,
            tags: dict, history: list[dict] | None = None, artifacts: list[Path] = ()) -> str:
    """Log one finished stage execution as an MLflow run; return its run id."""
    uri = resolve_uri(cfg, repo_root)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    exp_id = _experiment_id(client, cfg, uri, repo_root)
    run = client.create_run(exp_id, run_name=run_name, tags={k: str(v) for k, v in tags.items() if v is not None})
    rid = run.info.run_id
    try:
        flat_params = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
        scalar_metrics = {k: _metric_value(v) for k, v in flatten(metrics).items()}
        ms = [Metric(k.replace(".", "/"), v, 0, 0) for k, v in scalar_metrics.items() if v is not None]
        for row in history or []:
            step = int(row["epoch"])
            for key, value in row.items():
                v = _metric_value(value)
                if key != "epoch" and v is not None:
                    ms.append(Metric(f"epoch/{key}", v, 0, step))
        for i in range(0, len(flat_params), 100):  # log_batch takes at most 100 params a call
            client.log_batch(rid, params=flat_params[i:i + 100])
        for i in range(0, len(ms), 1000):
            client.log_batch(rid, metrics=ms[i:i + 1000])
        for path in artifacts:
            if Path(path).is_file():
                client.log_artifact(rid, str(path))
            elif Path(path).is_dir():
                client.log_artifacts(rid, str(path), artifact_path=Path(path).name)
        client.set_terminated(rid, "FINISHED")
    except BaseException:
        client.set_terminated(rid, "FAILED")
        raise
    return rid


def safe_log_run(**kwargs) -> str | None:
    """``log_run``, but a tracking failure is a warning: the results are already on disk."""
    try:
        rid = log_run(**kwargs)
    except Exception as err:  # any store or network failure
        print(f"warning: MLflow logging failed ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
              "the results are on disk", flush=True)
        return None
    print(f"MLflow: logged run {kwargs['run_name']} ({rid}) to {resolve_uri(kwargs['cfg'], kwargs['repo_root'])}",
          flush=True)
    return rid


def run_tags(variant: str, metrics: dict, env_info: dict, *, stage: str) -> dict:
    """Tags that make one pipeline execution's runs easy to find and compare in the UI."""
    from ampbench.env import fingerprint, git_commit
    return {
        "stage": stage, "variant": variant, "precision": metrics.get("precision"),
        "accum_steps": metrics.get("accum_steps"), "git_commit": metrics.get("git_commit") or git_commit(),
        "dvc_exp_name": os.environ.get("DVC_EXP_NAME"), "env_fingerprint": fingerprint(env_info),
    }
