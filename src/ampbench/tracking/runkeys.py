"""A run's key, the mark that it was logged whole: set last, so a run cut short mid-logging is partial, and the
rules that find the one whole run of some results, delete partial and duplicate ones, and tell the store's
transient failures from the caller's own.

Two more tags find what a key alone cannot. A run's slot (``SLOT_TAG``) is where its results live: this checkout of
the project, the DVC experiment and the run's name. A stage killed while it logged (SIGKILL, a container stopped)
leaves a partial run and no marker, and its rerun writes new results, so a new key, into the same slot: the partial
run of the old key is found by the slot and deleted. A log's attempt (``ATTEMPT_TAG``) is one call of ``log_run``:
MLflow's client retries every request, POSTs included, so a ``runs/create`` or ``logged-models`` that the server
applied but whose answer was lost is applied again; the run or LoggedModel made first is found by the attempt and
deleted."""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path

from mlflow.tracking import MlflowClient

from ampbench.errors import NotTheAnalysis, first_line

KEY_TAG = "ampbench.run_key"  # set last: the run is whole
PENDING_TAG = "ampbench.run_key_pending"  # set first: the run is being logged
SLOT_TAG = "ampbench.results_slot"  # where the results live: new results there supersede a partial run of old ones
ATTEMPT_TAG = "ampbench.log_attempt"  # one log call: the runs and LoggedModels a retried POST made twice share it


class RunRemoved(RuntimeError):
    """A run removed by another writer while this one logged it: the log did not take; a later sync logs it."""


def slot(project: Path, run_name: str) -> str:
    """The slot of ``run_name``'s results in ``project`` (the repository a DVC experiment belongs to): this checkout
    (an id kept in its ``.ampbench/``, the same across a container's restarts where the project is a volume, and
    not shared by two clones), the current DVC experiment (``DVC_EXP_NAME``; the workspace when unset) and the
    run's name."""
    mark = Path(project) / ".ampbench" / "checkout"
    try:
        checkout = mark.read_text().strip()
    except OSError:
        checkout = ""
    if not checkout:
        checkout = uuid.uuid4().hex  # where it cannot be kept, a slot of its own: nothing is found by it
        with contextlib.suppress(OSError):
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.write_text(checkout + "\n")
    where = "\0".join((checkout, os.environ.get("DVC_EXP_NAME", ""), run_name))
    return hashlib.sha256(where.encode()).hexdigest()[:20]


def attempt() -> str:
    """A new log call's attempt id."""
    return uuid.uuid4().hex


def transient(err: BaseException) -> bool:
    """Whether ``err`` is the tracking store's, and may pass (a connection refused or reset, a time-out, HTTP 408,
    429 or 5xx after MLflow's retries), rather than a permanent refusal (401, 403, 404) or the caller's own."""
    import requests
    from mlflow.exceptions import MlflowException
    if isinstance(err, ConnectionError | TimeoutError | requests.exceptions.RequestException):
        return True
    if isinstance(err, MlflowException):
        code = err.get_http_status_code()
        return code >= 500 or code in (408, 429)
    return False


def _store_failures_pass(fn, *args):
    """``fn(*args)``, its failure an analysis's own unless the store failed under it: then the run being logged
    is not whole, and stays partial for the replay to complete."""
    try:
        return fn(*args)
    except Exception as err:
        if transient(err):
            raise NotTheAnalysis(first_line(err)) from err
        raise


def create_experiment(client: MlflowClient, name: str, **kw) -> str:
    """``client.create_experiment``, where another writer (or this one's retried POST, its answer lost) may have
    made it first: then the one made."""
    from mlflow.exceptions import MlflowException
    try:
        return client.create_experiment(name, **kw)
    except MlflowException as err:
        made = client.get_experiment_by_name(name) if err.error_code == "RESOURCE_ALREADY_EXISTS" else None
        if made is None:
            raise
        return made.experiment_id


def log_output_once(client: MlflowClient, rid: str, model_id: str) -> None:
    """Mark LoggedModel ``model_id`` as run ``rid``'s output, where a retried POST may have marked it already (the
    store then refuses the second as a duplicate)."""
    from mlflow.entities import LoggedModelOutput
    from mlflow.exceptions import MlflowException
    try:
        client.log_outputs(rid, [LoggedModelOutput(model_id, 0)])
    except MlflowException:
        if model_id not in {o.model_id for o in client.get_run(rid).outputs.model_outputs}:
            raise


def _runs_of(client: MlflowClient, exp_id: str, key: str, slot: str | None = None) -> list:
    """Every run of ``key``, whole or partial, in any status (a retired one too, whose retirement was cut short:
    it is retired again); with ``slot``, also the partial runs of other results in that slot, which newer results
    there have superseded (their own whole runs stay)."""
    found = {}
    for tag, value in ((KEY_TAG, key), (PENDING_TAG, key), (SLOT_TAG, slot)):
        if value is None:
            continue
        unfinished = " and attributes.status != 'FINISHED'" if tag == SLOT_TAG else ""  # not a slot's whole runs
        for run in client.search_runs([exp_id], filter_string=f"tags.`{tag}` = '{value}'{unfinished}",
                                      max_results=100):
            tags = run.data.tags
            if tag != SLOT_TAG or (PENDING_TAG in tags and not is_whole(run, tags[PENDING_TAG])):
                found[run.info.run_id] = run
    return list(found.values())


def drop_twins(client: MlflowClient, exp_id: str, rid: str, tried: str, model_id: str | None = None) -> None:
    """Delete what a retried POST of attempt ``tried`` made besides run ``rid`` and its LoggedModel ``model_id``
    (with ``model_id``: the LoggedModels of ``rid`` alone)."""
    if model_id is not None:
        _drop_models(client, [m for m in client.search_logged_models(
            [exp_id], filter_string=f"source_run_id = '{rid}'") if m.model_id != model_id])
        return
    for run in client.search_runs([exp_id], filter_string=f"tags.`{ATTEMPT_TAG}` = '{tried}'", max_results=100):
        if run.info.run_id != rid:
            _delete(client, exp_id, run.info.run_id)


def is_whole(run, key: str, status: str | None = None) -> bool:
    """``run`` is a whole run of ``key``: its key set (last), its status the one it was to end with, not retired."""
    return (run.data.tags.get(KEY_TAG) == key and RETIRED_TAG not in run.data.tags
            and (run.info.status == status or (status is None and run.info.status in ("FINISHED", "FAILED"))))


def complete_run(client: MlflowClient, exp_id: str, key: str, status: str | None = None) -> str | None:
    """The id of the whole run of ``key``: its key set (last) and its status the one it was to end with
    (``status``; FINISHED or FAILED as the stage said, when not given); of several (two writers), the first
    made. None when there is none."""
    runs = [r for r in client.search_runs([exp_id], filter_string=f"tags.`{KEY_TAG}` = '{key}'", max_results=100)
            if is_whole(r, key, status)]
    if not runs:
        return None
    first = min(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id))
    for other in runs:
        if other.info.run_id != first.info.run_id:
            _delete(client, exp_id, other.info.run_id)
    return first.info.run_id


WAIT_S = 60.0  # how long a log whose run another writer retired waits for that writer's whole run


def await_whole(client: MlflowClient, exp_id: str, key: str, status: str | None = None) -> str | None:
    """The whole run of ``key`` once one appears within ``WAIT_S`` (another writer of the same results, which took
    this writer's run for a partial one, finishing its own); None if none does."""
    import time
    deadline = time.monotonic() + WAIT_S
    while True:
        found = complete_run(client, exp_id, key, status)
        if found is not None or time.monotonic() > deadline:
            return found
        time.sleep(min(2.0, WAIT_S / 10))


RETIRED_TAG = "ampbench.retired"  # a partial or duplicate run an account without MANAGE could not delete


def _delete(client: MlflowClient, exp_id: str, rid: str) -> None:
    """Delete a partial or duplicate run, and the LoggedModel it made. An account with EDIT alone may not delete
    runs (MLflow's basic-auth asks for MANAGE): the run is retired instead, FAILED (out of every comparison),
    tagged why, and without its key tags (out of every replay's search); the key tags go last, so a retirement
    cut short is found and retired again."""
    from mlflow.exceptions import MlflowException

    from ampbench.tracking import access
    made = []
    with contextlib.suppress(Exception):  # a store without LoggedModels
        made = list(client.search_logged_models([exp_id], filter_string=f"source_run_id = '{rid}'"))
    try:
        _drop_models(client, made, keep_refusal=True)
        client.delete_run(rid)
    except MlflowException as err:
        if access.status(err) != 403:
            raise
        # each step leaves the run found again and retired again if the next is cut: the tag that marks it first,
        # its key (whole) before its status, its pending key last
        client.set_tag(rid, RETIRED_TAG, "partial or duplicate: its results are in another run of this experiment")
        with contextlib.suppress(MlflowException):  # a run that never had its key
            client.delete_tag(rid, KEY_TAG)
        client.set_terminated(rid, "FAILED")
        _drop_models(client, made, may_delete=False)
        with contextlib.suppress(MlflowException):
            client.delete_tag(rid, PENDING_TAG)
        print(f"MLflow: kept run {rid} as FAILED and tagged {RETIRED_TAG} rather than deleting it: deleting runs "
              "needs MANAGE on the experiment, and this account has less", flush=True)


def _drop_models(client: MlflowClient, made: list, keep_refusal: bool = False, may_delete: bool = True) -> None:
    """Delete the LoggedModels ``made``; one this account may not delete (MLflow's basic-auth asks for MANAGE) is
    marked FAILED instead, or with ``keep_refusal`` the refusal is raised (the caller retires the run whole)."""
    from mlflow.exceptions import MlflowException

    from ampbench.tracking import access
    for m in made:
        if may_delete:
            try:
                client.delete_logged_model(m.model_id)
                continue
            except MlflowException as err:  # a store that keeps no LoggedModels: only a refusal matters
                if access.status(err) != 403:
                    continue
                if keep_refusal:
                    raise
        with contextlib.suppress(MlflowException):  # a model deleted, or finalized already
            client.finalize_logged_model(m.model_id, "FAILED")
