"""Several writers of the same results, and what a killed log leaves: a run another writer completed meanwhile is
kept, one retired under its writer is waited on and never counted twice, and the partial run a killed log left is
replaced when new results are logged in its place."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from ampbench import config, results, tracking


def _one_key_log(tmp_path):
    return {"run_name": "train@fp32", "key": "0123456789abcdef0123", "params": {"lr": 0.1}, "metrics": {"acc": 0.5},
            "tags": {}}


def test_a_run_another_writer_completed_after_the_first_look_is_kept_not_deleted_as_partial(tmp_mlflow, tmp_path,
                                                                                            monkeypatch):
    """Two machines log the same results: the second looks (no whole run yet), the first completes its run, and
    the second's sweep of partial runs must not take that whole run for one: it is the run, kept, logged once."""
    cfg, args = config.MlflowConfig(), _one_key_log(tmp_path)
    theirs, new = tracking.log_run(cfg, tmp_path, **args)
    assert new
    real, looks = tracking.complete_run, [0]

    def first_look_before_theirs(*a, **kw):
        looks[0] += 1
        return None if looks[0] == 1 else real(*a, **kw)

    monkeypatch.setattr(tracking, "complete_run", first_look_before_theirs)
    assert tracking.log_run(cfg, tmp_path, **args) == (theirs, False)
    client = MlflowClient(tmp_mlflow)
    runs = client.search_runs([client.get_experiment_by_name("ampbench").experiment_id])
    assert [(r.info.run_id, r.info.status) for r in runs] == [(theirs, "FINISHED")]


def test_a_run_retired_under_its_writer_is_a_failed_log_with_its_marker_not_already_logged(tmp_mlflow, tmp_path,
                                                                                           monkeypatch, capsys):
    """Another writer took this run, mid-logging, for a partial one and retired it, and kept none: the log did not
    take. It is said as a failure, and the marker stays for `ampbench mlflow-sync`, not "already logged (run None)"."""
    cfg, args = config.MlflowConfig(), _one_key_log(tmp_path)
    real, looks = tracking.complete_run, [0]

    def retired_meanwhile(*a, **kw):
        looks[0] += 1
        return None if looks[0] == 2 else real(*a, **kw)

    monkeypatch.setattr(tracking, "complete_run", retired_meanwhile)
    monkeypatch.setattr(tracking.runkeys, "WAIT_S", 0.1)  # and no other writer completes a run of them
    assert tracking.safely("train@fp32", lambda c, root: tracking.log_run(c, root, **args), cfg, tmp_path) is None
    out = capsys.readouterr().out
    assert "warning: MLflow logging of train@fp32 failed" in out and "removed while it was logged" in out
    assert "already logged" not in out
    assert results.pending_line(tracking.project_root(tmp_path)).startswith("1 result(s) are on disk but not in")


def test_new_results_where_a_killed_log_left_a_partial_run_replace_it(tmp_mlflow, tmp_path, monkeypatch):
    """A stage killed while it logged (SIGKILL, a container stopped) leaves its run RUNNING, partial, and no marker;
    its rerun writes new results (a new key) in the same place. Their log deletes that partial run, found by the
    place (this checkout of the project, experiment, variant); an earlier whole run of that place stays, and so
    does a partial run of another DVC experiment, which may be logging still."""
    cfg, args = config.MlflowConfig(), _one_key_log(tmp_path)
    earlier, _ = tracking.log_run(cfg, tmp_path, **args)

    def killed(self, *a, **kw):
        raise SystemExit(137)  # nothing after it reaches the server
    for exp_name, key in (("", "killed-in-the-workspace"), ("bushy-tuba", "killed-in-an-experiment")):
        monkeypatch.setenv("DVC_EXP_NAME", exp_name)
        with monkeypatch.context() as m:
            m.setattr(MlflowClient, "log_batch", killed)
            m.setattr(MlflowClient, "set_terminated", killed)
            with pytest.raises(SystemExit):
                tracking.log_run(cfg, tmp_path, **{**args, "key": key})
    monkeypatch.setenv("DVC_EXP_NAME", "")
    rerun, new = tracking.log_run(cfg, tmp_path, **{**args, "key": "the-rerun-s-results"})
    client = MlflowClient(tmp_mlflow)
    runs = client.search_runs([client.get_experiment_by_name("ampbench").experiment_id])
    found = {r.data.tags.get(tracking.KEY_TAG) or r.data.tags[tracking.PENDING_TAG]: r.info.status for r in runs}
    assert new and found == {args["key"]: "FINISHED", "the-rerun-s-results": "FINISHED",
                             "killed-in-an-experiment": "RUNNING"}


def test_a_writer_whose_run_another_retired_waits_for_that_one_s_and_compare_counts_it_once(tmp_mlflow, tmp_path,
                                                                                            monkeypatch):
    """Two machines sync the same results at once (benchmarks/load.py): B takes A's run, still being logged, for
    a partial one and retires it, and logs its own; A's last look finds no whole run, since B's is not done. A
    makes its retirement whole (keyless, FAILED) and waits for B's run, which it reports as the one logged: no
    false failure, and `ampbench compare` counts the results once."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED

    from ampbench.tracking import runkeys
    cfg = config.MlflowConfig()
    args = {**_one_key_log(tmp_path), "metrics": {"imgs_per_s": 100.0}, "tags": {"stage": "train", "variant": "x"}}
    key, theirs = args["key"], []
    real_tag, real_look = MlflowClient.set_tag, runkeys.complete_run

    def refused(self, rid):  # an account with EDIT alone (each machine's, on a team's server): runs are retired
        raise MlflowException("Permission denied", error_code=PERMISSION_DENIED)

    def b_starts(self, rid, tag, value, *a, **kw):  # as A is about to set its key, B looks, retires A's, logs
        if tag == tracking.KEY_TAG and not theirs:
            exp = self.get_experiment_by_name("ampbench").experiment_id
            for partial in runkeys._runs_of(self, exp, key):
                runkeys._delete(self, exp, partial.info.run_id)
            theirs.append(self.create_run(exp, tags={tracking.PENDING_TAG: key, "stage": "train", "variant": "x"}))
            self.log_metric(theirs[0].info.run_id, "imgs_per_s", 100.0)
        return real_tag(self, rid, tag, value, *a, **kw)

    def b_finishes(client, *a, **kw):  # while A waits
        real_tag(client, theirs[0].info.run_id, tracking.KEY_TAG, key)
        client.set_terminated(theirs[0].info.run_id, "FINISHED")
        return real_look(client, *a, **kw)

    monkeypatch.setattr(MlflowClient, "delete_run", refused)
    monkeypatch.setattr(MlflowClient, "set_tag", b_starts)
    monkeypatch.setattr(runkeys, "complete_run", b_finishes)
    theirs_id = lambda: theirs[0].info.run_id  # noqa: E731
    assert tracking.log_run(cfg, tmp_path, **args) == (theirs_id(), False)
    theirs[:] = [theirs_id()]
    client = MlflowClient(tmp_mlflow)
    exp = client.get_experiment_by_name("ampbench").experiment_id
    runs = {r.info.run_id: r for r in client.search_runs([exp])}
    [mine] = set(runs) - set(theirs)
    assert runs[theirs[0]].info.status == "FINISHED" and tracking.KEY_TAG in runs[theirs[0]].data.tags
    assert runs[mine].info.status == "FAILED" and tracking.KEY_TAG not in runs[mine].data.tags
    assert sum(len(v) for m in tracking.compare.collect(client, exp).values() for v in m.values()) == 1
    client.set_terminated(mine, "FINISHED")  # a retired run FINISHED (an older ampbench's): still not counted
    client.set_tag(mine, tracking.KEY_TAG, args["key"])
    assert sum(len(v) for m in tracking.compare.collect(client, exp).values() for v in m.values()) == 1
