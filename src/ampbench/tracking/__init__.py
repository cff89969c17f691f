"""MLflow tracking: the only package that imports mlflow (``compare``: what each machine's runs bought).

Where runs go: ``$MLFLOW_TRACKING_URI`` if set, else ``mlflow.tracking_uri`` in
params.yaml, else ``sqlite:///<repo>/mlflow.db`` with artifacts in
``<repo>/mlartifacts``. Logging happens after a stage has written its results to
disk, and a failure to log is a warning, never a lost run: ``ampbench
mlflow-sync`` logs the on-disk runs later. Each run carries a key (a hash of its
metrics file), so logging the same results twice adds nothing.

A run is marked with its key only once it is whole: it is created with the key as pending, filled in, given the
key, then terminated with its status. A run found with the key pending, or with the key but not the status it
was to end with (a failure mid-logging, a server that went down), is partial: the next log of the same results
(``ampbench mlflow-sync``) deletes it, and its LoggedModel, and logs the run anew. Two writers of the same results
(a sync while the stage logs) keep the first complete run and delete the other. A transient failure (a
connection refused or reset, HTTP 408, 429, 5xx) is retried by MLflow's own retry, a few times with backoff
(seconds in all, not minutes); a permanent one (401, 403, 404, a bad URI) is not.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from datetime import datetime
from pathlib import Path

# A transient failure retried 3 times, after 0, 2 and 4 s (and up to half a second of jitter): an unreachable server
# costs a stage seconds, not MLflow's default 7 retries over minutes; `mlflow-sync` takes 6 unless the user set it.
RETRIES_GIVEN = "MLFLOW_HTTP_REQUEST_MAX_RETRIES" in os.environ
for _name, _value in (("MAX_RETRIES", "3"), ("BACKOFF_FACTOR", "1"), ("BACKOFF_JITTER", "0.5"), ("TIMEOUT", "10")):
    os.environ.setdefault(f"MLFLOW_HTTP_REQUEST_{_name}", _value)

from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from ampbench import results  # noqa: E402
from ampbench.config import MlflowConfig, flatten, project_root, redact_text, tracking_uri  # noqa: E402
from ampbench.errors import analysis  # noqa: E402
from ampbench.results import fingerprint, git_commit  # noqa: E402
from ampbench.tracking import access, runkeys  # noqa: E402
from ampbench.tracking.logged_model import _log_model, _pins_taken_as_read, load_weights  # noqa: E402, F401
from ampbench.tracking.runkeys import (  # noqa: E402, F401  the run key's rules (compare and the tests read them)
    KEY_TAG,
    PENDING_TAG,
    RunRemoved,
    _delete,
    _runs_of,
    _store_failures_pass,
    complete_run,
    is_whole,
    transient,
)

# MLflow 3's UI reads this experiment tag to know what kind of experiment it shows; without it the UI asks, and
# leans to the GenAI (traces) view. Training runs are "custom model development": the runs table and charts.
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"
CONTEXT_TAG = "mlflow.data.context"  # a dataset input's role: training or evaluation


def _experiment_id(client: MlflowClient, cfg: MlflowConfig, uri: str, repo_root: Path) -> str:
    exp = client.get_experiment_by_name(cfg.experiment)
    if exp is not None:
        if KIND_TAG not in exp.tags:  # made by an older ampbench, or by hand: mark it, never overwrite a choice
            try:
                client.set_experiment_tag(exp.experiment_id, KIND_TAG, KIND)
            except MlflowException as err:  # an account with READ alone: its runs' own calls will say so
                if access.status(err) != 403:
                    raise
                print(f"MLflow: skipped marking experiment {cfg.experiment!r} for the UI's training view: "
                      f"{access.for_status(403, cfg.experiment)}", flush=True)
        return exp.experiment_id
    artifacts = None
    if uri.startswith(("sqlite:", "file:")) or "://" not in uri:
        artifacts = (project_root(repo_root) / "mlartifacts").as_uri()
    return runkeys.create_experiment(client, cfg.experiment, artifact_location=artifacts, tags={KIND_TAG: KIND})


def prepare_ui(cfg: MlflowConfig, uri: str, repo_root: Path) -> str | None:
    """The experiment's id, marked as a training experiment for the UI; None if no run was logged yet."""
    client = MlflowClient(uri)
    if client.get_experiment_by_name(cfg.experiment) is None:
        return None
    return _experiment_id(client, cfg, uri, repo_root)


def latest_pipeline(uri: str, experiment_id: str) -> str | None:
    """The ampbench.pipeline tag of the newest run: the filter that shows one pipeline's runs."""
    runs = MlflowClient(uri).search_runs([experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].data.tags.get("ampbench.pipeline") if runs else None


def ui_url(base: str, experiment_id: str | None) -> str:
    """The experiment's runs table in the Machine Learning view of MLflow 3's UI (not the GenAI overview)."""
    where = f"experiments/{experiment_id}/runs" if experiment_id else "experiments"
    return f"{base.rstrip('/')}/#/{where}?workflowType=machine_learning"


def _metric_value(value) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _epoch_key(column: str) -> str:
    """history.csv column -> MLflow key: eval_acc -> eval/acc, train_loss -> train/loss, lr -> train/lr."""
    if column.startswith("eval_"):
        return "eval/" + column[len("eval_"):]
    return "train/" + column.removeprefix("train_")


def file_key(*paths: Path) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:20]


def pipeline_id(plans_dir: Path, env_path: Path) -> str:
    """The same for every run of one pipeline configuration (all variants' plans and this machine)."""
    files = sorted(Path(plans_dir).glob("*.json")) + [Path(env_path)]
    return file_key(*[f for f in files if f.is_file()])[:12]


def log_run(cfg: MlflowConfig, repo_root: Path, *, run_name: str, key: str, params: dict, metrics: dict,
            tags: dict, history: list[dict] | None = None, artifacts: list[Path] = (),
            series: list[Metric] = (), inputs: list[DatasetInput] = (), start_ms: int | None = None,
            end_ms: int | None = None, status: str = "FINISHED", model: Path | None = None) -> tuple[str, bool]:
    """Log one finished stage execution as an MLflow run, with the stage's own start and end times and status
    (logging happens after the work); (run id, whether it was new)."""
    uri = tracking_uri(cfg, repo_root)
    client = MlflowClient(uri)
    exp_id = _experiment_id(client, cfg, uri, repo_root)
    whole = complete_run(client, exp_id, key, status)
    if whole is not None:
        return whole, False
    slot, tried = runkeys.slot(project_root(repo_root), run_name), runkeys.attempt()
    for partial in _runs_of(client, exp_id, key, slot):  # a failure mid-logging left these: they are replaced
        if is_whole(partial, key, status):  # another writer of the same results completed it since the look above
            return partial.info.run_id, False
        _delete(client, exp_id, partial.info.run_id)
    tags = {**{k: redact_text(str(v)) for k, v in tags.items() if v is not None}, PENDING_TAG: key,  # no password
            runkeys.SLOT_TAG: slot, runkeys.ATTEMPT_TAG: tried}
    rid = client.create_run(exp_id, start_time=start_ms, run_name=run_name, tags=tags).info.run_id
    try:
        if inputs:
            client.log_inputs(rid, datasets=list(inputs))
        model_id = None
        if model:  # an analysis: a model that cannot be logged leaves the run logged without it, and says why
            model_id, why = analysis("logged_model", run_name, _store_failures_pass, _log_model, client, uri,
                                     exp_id, rid, run_name, model, tags)
            if why:
                client.set_tag(rid, "ampbench.logged_model", f"not logged: {why}; the weights are in {model}")
        flat_params = [Param(k, redact_text(str(v))[:6000]) for k, v in flatten(params).items()]
        ms = [Metric(k.replace(".", "/"), v, 0, 0, model_id=model_id if k in MODEL_METRICS else None) for k, v in
              ((k, _metric_value(v)) for k, v in flatten(metrics).items()) if v is not None]
        for row in history or []:
            for name, value in row.items():
                v = _metric_value(value)
                if name != "epoch" and v is not None:
                    ms.append(Metric(_epoch_key(name), v, 0, int(row["epoch"])))  # step = epoch
        ms += list(series)
        for i in range(0, len(flat_params), 100):  # log_batch takes at most 100 params a call
            client.log_batch(rid, params=flat_params[i:i + 100])
        for i in range(0, len(ms), 1000):
            client.log_batch(rid, metrics=ms[i:i + 1000])
        for path in artifacts:
            if Path(path).is_file():
                client.log_artifact(rid, str(path))
            elif Path(path).is_dir():
                client.log_artifacts(rid, str(path), artifact_path=Path(path).name)
        if model_id:
            runkeys.log_output_once(client, rid, model_id)
            client.finalize_logged_model(model_id, "READY")
            runkeys.drop_twins(client, exp_id, rid, tried, model_id)  # a LoggedModel made twice by a retried POST
        runkeys.drop_twins(client, exp_id, rid, tried)  # and a run, while this one is partial: a cut is replayed
        client.set_tag(rid, KEY_TAG, key)  # whole: from here on it counts as logged
        client.set_terminated(rid, status, end_time=end_ms)
    except BaseException:
        with contextlib.suppress(Exception):  # the server may be what failed: the run stays partial either way
            client.set_terminated(rid, "FAILED")
        raise
    kept = complete_run(client, exp_id, key, status)  # another writer of the same results may have finished too
    if kept is None:  # retired under it by another writer, which took it for a partial one: its retirement made
        _delete(client, exp_id, rid)  # whole (keyless, FAILED), the other writer's run awaited
        if (kept := runkeys.await_whole(client, exp_id, key, status)) is None:
            raise RunRemoved(f"the run of {run_name} was removed while it was logged (by another writer of the same "
                             "results?), and no other run of them was completed; log them again")
    if kept != rid:
        _delete(client, exp_id, rid)
        return kept, False
    return rid, True


JOBS_ENV = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


def server_env() -> dict[str, str]:
    """The environment an MLflow server for ampbench's runs starts in: without MLflow's job runners (its GenAI
    scorers, evaluations, issue detection, prompt optimisation and periodic tasks, which training runs never call:
    8 more processes, about 18 s more CPU as ``ampbench mlflow-ui`` starts on 2 cores), unless
    ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION`` is set already (``true`` keeps them)."""
    return {**os.environ, JOBS_ENV: os.environ.get(JOBS_ENV, "false")}


MODEL_METRICS = ("final_acc", "best_acc", "final_loss", "imgs_per_s", "peak_mem_bytes")  # also the LoggedModel's


def _tags(stage: str, variant: str, metrics: dict, env_info: dict, pipeline: str | None,
          command: str | None = None) -> dict:
    """Tags that make one pipeline's runs easy to find and compare in the UI (filter on ampbench.pipeline), and
    MLflow's own source tags: the stage's DVC command and the git commit it ran at (its command line in
    ampbench.command)."""
    commit = metrics.get("git_commit") or git_commit()
    gpu = env_info.get("gpu") or {}
    return {"ampbench.machine": gpu.get("name") or env_info.get("cpu_model"),  # what `ampbench compare` groups by
            "ampbench.driver": env_info.get("driver"), "ampbench.torch": env_info.get("torch"),
            "stage": stage, "variant": variant, "precision": metrics.get("precision"),
            "accum_steps": metrics.get("accum_steps"), "world_size": metrics.get("world_size"),
            "grad_comm": metrics.get("grad_comm"), "git_commit": commit,
            "dvc_exp_name": os.environ.get("DVC_EXP_NAME"), "env_fingerprint": fingerprint(env_info),
            "ampbench.pipeline": pipeline, "ampbench.command": command, "mlflow.source.type": "LOCAL",
            # what reruns it, shown whole in the runs table's Source column (the UI shows a path's last part)
            "mlflow.source.name": f"dvc repro {stage}" + (f"@{variant}" if stage == "train" else ""),
            "mlflow.source.git.commit": commit}


def _ms(iso: str | None) -> int | None:
    """An ISO time (a run's started_at, finished_at) in epoch milliseconds, as MLflow takes it."""
    try:
        return int(datetime.fromisoformat(iso).timestamp() * 1000) if iso else None
    except ValueError:
        return None


def dataset_inputs(record: dict | None) -> list[DatasetInput]:
    """The prepared set as MLflow dataset inputs: its training split (context training) and its evaluation split
    (context evaluation), named by source, with the digest of the prepared files and each split's size."""
    if not record:
        return []
    out = []
    for split, context in (("train", "training"), ("test", "evaluation")):
        profile = {"num_rows": record[f"{split}_count"], "num_classes": record.get("num_classes"),
                   "image_shape": record.get("image_shape")}
        ds = Dataset(name=f"{record['name']}-{split}", digest=record["digest"], source_type="local",
                     source=json.dumps({"uri": record["source"]}), profile=json.dumps(profile))
        out.append(DatasetInput(ds, tags=[InputTag(CONTEXT_TAG, context)]))
    return out


def _series(run: dict) -> list[Metric]:
    """The loss scale per optimizer step, and the system samples per sampling step."""
    out = [Metric("train/loss_scale_by_step", float(r["scale"]), 0, int(r["step"])) for r in run["scale"]]
    out += [Metric("train/grad_norm", v, 0, int(r["step"])) for r in run.get("grad_norm") or []
            if (v := _metric_value(r["grad_norm"])) is not None and math.isfinite(v)]
    for i, row in enumerate(run.get("system") or []):
        for key, value in row.items():
            v = _metric_value(value)
            if key != "t_s" and v is not None and value != "":
                out.append(Metric(f"system/{key}", v, int(float(row["t_s"]) * 1000), i))
    return out


def log_variant(cfg: MlflowConfig, repo_root: Path, run_dir: Path, plan: dict, env_info: dict,
                pipeline: str | None = None) -> tuple[str, bool]:
    """Log a train stage's run folder as one run: its metrics, per-epoch history and series (which MLflow
    charts itself) and its files. The figures are the report's, logged with the report run."""
    run = results.read_run(run_dir)
    m = run["metrics"]
    files = [run_dir / name for name in (results.METRICS, *(t.file for t in results.TABLES.values()),
                                         results.TRACE)]
    tags = _tags("train", m["variant"], m, env_info, pipeline, m.get("command"))
    tags["ampbench.status"] = m.get("status", "complete")
    if m.get("diagnosis"):  # a run stopped by inf/NaN: the first bad layer and gradient, searchable
        tags["ampbench.diagnosis"] = json.dumps(m["diagnosis"])[:5000]
    return log_run(cfg, repo_root, run_name=f"train@{m['variant']}", key=file_key(run_dir / results.METRICS),
                   params=plan, metrics={k: v for k, v in m.items() if k != "dataset"}, history=run["history"],
                   series=_series(run), tags=tags, artifacts=files,
                   inputs=dataset_inputs(m.get("dataset")), start_ms=_ms(m.get("started_at")),
                   end_ms=_ms(m.get("finished_at")),
                   status="FINISHED" if m.get("status", "complete") == "complete" else "FAILED",
                   model=run_dir / results.MODEL if cfg.log_model and (run_dir / results.MODEL).is_file() else None)


def log_report(cfg: MlflowConfig, repo_root: Path, report_md: Path, summary_json: Path, fig_dir: Path,
               env_info: dict, pipeline: str | None = None, built_ms: tuple[int, int] | None = None,
               report_html: Path | None = None, metrics_json: Path | None = None) -> tuple[str, bool]:
    """The report stage's run: report.md, report.html (the page MLflow's artifact view renders), metrics.json,
    summary.json and the figures; ``built_ms``: when the report was built."""
    summary = json.loads(Path(summary_json).read_text())
    start, end = built_ms or (None, None)
    pages = [p for p in (report_html, metrics_json) if p is not None and Path(p).is_file()]
    return log_run(cfg, repo_root, run_name="report", key=file_key(summary_json, report_md),
                   params={"variants": ",".join(summary["variants"]), "baseline": summary["baseline"]},
                   metrics={"variants": summary["variants"]}, start_ms=start, end_ms=end,
                   tags=_tags("report", "report", {}, env_info, pipeline),
                   artifacts=[report_md, *pages, summary_json, fig_dir])


def safely(what: str, fn, cfg: MlflowConfig, repo_root: Path, *args, results_of: tuple[Path, ...] = ()) -> str | None:
    """Run a logging call; a tracking failure is a warning, since the results are already on disk, and leaves a
    marker that says so (``pending``) until a log of the same results (``results_of``: the files that identify
    them) succeeds."""
    marker = results.pending_marker(project_root(repo_root), what, results_of)
    try:
        rid, new = fn(cfg, repo_root, *args)
    except Exception as err:  # any store or network failure
        why = access.describe(err, cfg.experiment)  # a credential, a right, a CA: said as what to do
        print(f"warning: MLflow logging of {what} failed ({why}); the results are on disk: log them later with "
              "`ampbench mlflow-sync`", flush=True)
        with contextlib.suppress(OSError):  # a marker that cannot be written must not hide the warning
            results.write_pending(marker, what, why, results_of)
        return None
    marker.unlink(missing_ok=True)
    print(f"MLflow: {'logged' if new else 'already logged:'} {what} (run {rid})", flush=True)
    return rid


def sync(cfg: MlflowConfig, repo_root: Path, runs_dir: Path, plans_dir: Path, env_path: Path,
         report_md: Path, summary_json: Path, fig_dir: Path, report_html: Path | None = None,
         metrics_json: Path | None = None) -> int:
    """Log every on-disk run not yet in MLflow (the train runs, then the report); return how many failed."""
    env_info = json.loads(Path(env_path).read_text()) if Path(env_path).is_file() else {}
    pipeline = pipeline_id(plans_dir, env_path)
    failed = 0
    names = sorted(d.name for d in Path(runs_dir).iterdir() if (d / results.METRICS).is_file()) \
        if Path(runs_dir).is_dir() else []
    for name in names:  # each read where it is logged: an unreadable one is a warning naming it, and the sync goes on
        plan_file = Path(plans_dir) / f"{name}.json"
        plan = json.loads(plan_file.read_text()) if plan_file.is_file() else {}
        failed += safely(f"train@{name}", log_variant, cfg, repo_root, Path(runs_dir) / name, plan, env_info,
                         pipeline, results_of=(Path(runs_dir) / name / results.METRICS,)) is None
    if Path(summary_json).is_file():
        failed += safely("report", log_report, cfg, repo_root, report_md, summary_json, fig_dir, env_info,
                         pipeline, None, report_html, metrics_json, results_of=(summary_json, report_md)) is None
        failed += safely("the ratios on the training runs", log_comparison, cfg, repo_root, summary_json,
                         runs_dir, results_of=(summary_json,)) is None
    for gone in results.drop_gone_pending(project_root(repo_root)):
        print(f"MLflow: no longer pending: {gone}, whose results are no longer on disk", flush=True)
    return failed


# what each variant bought, put on its training run (the compare command reads it back)
from ampbench.tracking.compare import COMPARE, comparison_metrics, log_comparison  # noqa: E402, F401
