"""Nothing lost in MLflow: a log cut at any point is completed once by the replay, the sync goes on past an
unreadable run folder, and a failed log stays visible until a log succeeds."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from ampbench import config, results, tracking
from ampbench.errors import NotTheAnalysis

# where a variant's logging can be cut (the server gone, a reset): (the client call, which of its calls fails); one
# in each phase: after the run is created, mid-metrics, mid-artifacts, in the LoggedModel, just before the key
KILL_POINTS = [("log_inputs", 1), ("log_batch", 2), ("log_artifact", 2), ("create_logged_model", 1), ("set_tag", 1)]


def _faults():
    """benchmarks/faults.py, as a module: its proxy, its server and its trained run folder."""
    import importlib.util

    from ampbench.sandbox import REPO_ROOT
    spec = importlib.util.spec_from_file_location("faults", REPO_ROOT / "benchmarks" / "faults.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def logged_run_folder(tmp_path_factory):
    """A trained variant's run folder (small_cnn, one epoch) with its model; (the folder, its plan)."""
    return _faults().run_folder(tmp_path_factory.mktemp("run"))


@pytest.mark.parametrize(("call", "nth"), KILL_POINTS)
def test_a_log_cut_at_any_point_is_completed_once_by_the_replay(logged_run_folder, tmp_path, monkeypatch, call,
                                                                 nth):
    """The first log fails at one call; the replay (what `ampbench mlflow-sync` runs) leaves exactly one run of
    those results in the store, FINISHED, with its metrics, its files and its LoggedModel, and nothing partial."""
    repo, plan = logged_run_folder
    store = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    cfg, run_dir = config.MlflowConfig(log_model=True), repo / "runs" / "fp32"
    real, calls = getattr(MlflowClient, call), [0]

    def cut(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            raise ConnectionError(f"connection reset at {call} #{nth}")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(MlflowClient, call, cut)
    with pytest.raises((ConnectionError, NotTheAnalysis)):  # the LoggedModel's calls: not the analysis's failure
        tracking.log_variant(cfg, repo, run_dir, plan, {})
    monkeypatch.setattr(MlflowClient, call, real)
    rid, new = tracking.log_variant(cfg, repo, run_dir, plan, {})
    assert new
    assert tracking.log_variant(cfg, repo, run_dir, plan, {}) == (rid, False)  # and once only
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("ampbench").experiment_id
    [run] = client.search_runs([exp])
    assert run.info.run_id == rid and run.info.status == "FINISHED"
    assert run.data.tags[tracking.KEY_TAG] == tracking.file_key(run_dir / results.METRICS)
    assert "final_acc" in run.data.metrics and run.data.params["train.batch_size"] == "32"
    assert {a.path for a in client.list_artifacts(rid)} >= {"metrics.json", "history.csv", "system.csv"}
    models = [m for m in client.search_logged_models([exp])]
    assert [(m.source_run_id, m.status.name) for m in models] == [(rid, "READY")]


def test_an_account_that_may_not_delete_runs_retires_the_partial_one_and_says_so(logged_run_folder, tmp_path,
                                                                                  monkeypatch, capsys):
    """EDIT without MANAGE (MLflow's basic-auth) may log but not delete: the replay keeps the partial run FAILED,
    tagged, without its key tags, so the store still holds one whole run of the results and `compare` one."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED
    repo, plan = logged_run_folder
    store = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    cfg, run_dir = config.MlflowConfig(log_model=False), repo / "runs" / "fp32"
    real = MlflowClient.set_tag

    def cut(self, rid, key, value, *a, **kw):  # the server gone just before the key
        if key == tracking.KEY_TAG:
            raise ConnectionError("connection reset")
        return real(self, rid, key, value, *a, **kw)
    monkeypatch.setattr(MlflowClient, "set_tag", cut)
    with pytest.raises(ConnectionError):
        tracking.log_variant(cfg, repo, run_dir, plan, {})
    monkeypatch.setattr(MlflowClient, "set_tag", real)

    def refused(self, rid):
        raise MlflowException("Permission denied", error_code=PERMISSION_DENIED)
    monkeypatch.setattr(MlflowClient, "delete_run", refused)
    rid, new = tracking.log_variant(cfg, repo, run_dir, plan, {})
    assert new and "kept run" in capsys.readouterr().out
    client = MlflowClient(store)
    runs = {r.info.run_id: r for r in client.search_runs([client.get_experiment_by_name("ampbench").experiment_id])}
    [old] = set(runs) - {rid}
    assert runs[rid].info.status == "FINISHED" and runs[old].info.status == "FAILED"
    assert tracking.runkeys.RETIRED_TAG in runs[old].data.tags
    assert not {tracking.KEY_TAG, tracking.PENDING_TAG} & set(runs[old].data.tags)
    assert tracking.log_variant(cfg, repo, run_dir, plan, {}) == (rid, False)  # and the replay is done


def test_the_sync_goes_on_past_an_unreadable_run_folder_and_names_it(logged_run_folder, tmp_path, monkeypatch,
                                                                     capsys):
    """And the report's ratios go onto whole runs only: a variant whose run is not in the store is named, and the
    call fails, so its marker stays until the sync that logs the run puts them on it."""
    import json
    import shutil
    repo, _ = logged_run_folder
    runs = tmp_path / "runs"
    shutil.copytree(repo / "runs" / "fp32", runs / "fp32")
    (runs / "broken").mkdir()
    (runs / "broken" / results.METRICS).write_text("")  # a disk that filled up as it was written
    store = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    cfg, summary = config.MlflowConfig(log_model=False), tmp_path / "summary.json"
    failed = tracking.sync(cfg, tmp_path, runs, tmp_path / "plans", tmp_path / "env.json", tmp_path / "report.md",
                           summary, tmp_path / "f")
    out = capsys.readouterr().out
    assert failed == 1 and "MLflow logging of train@broken failed (JSONDecodeError" in out
    assert "MLflow: logged train@fp32" in out
    summary.write_text(json.dumps({"variants": {"fp32": {"speedup": 1.0}, "broken": {"speedup": 1.5}}}))
    with pytest.raises(LookupError, match=r"^train@broken not in MLflow yet .* logged on fp32$"):
        tracking.log_comparison(cfg, tmp_path, summary, runs)
    [run] = MlflowClient(store).search_runs([MlflowClient(store).get_experiment_by_name("ampbench").experiment_id])
    assert run.data.metrics[tracking.COMPARE["speedup"]] == 1.0


def test_a_failed_log_leaves_a_visible_marker_that_a_successful_one_clears(tmp_path, monkeypatch, capsys):
    """Pending work is visible outside every stage's DVC dependencies: env_check and the report stage say what
    is on disk but not in MLflow until `ampbench mlflow-sync` logs it."""
    from ampbench.env import check
    monkeypatch.chdir(tmp_path)

    def down(cfg, root, *args):
        raise ConnectionError("connection refused")
    assert tracking.safely("train@fp32", down, config.MlflowConfig(), tmp_path) is None
    tracking.safely("report", down, config.MlflowConfig(), tmp_path)
    line = results.pending_line(tmp_path)
    assert line == ("2 result(s) are on disk but not in MLflow (report, train@fp32): log them with "
                    "`ampbench mlflow-sync`")
    assert line in check.tracking_warnings(config.from_dict({"mlflow": {"tracking_uri": "sqlite:///x.db"}}))
    assert not (tmp_path / "reports").exists()  # the markers are under .ampbench/, which no stage depends on
    assert tracking.safely("train@fp32", lambda cfg, root: ("r1", True), config.MlflowConfig(), tmp_path) == "r1"
    assert results.pending_line(tmp_path).startswith("1 result(s) are on disk but not in MLflow (report)")
    assert "MLflow: logged train@fp32 (run r1)" in capsys.readouterr().out


@pytest.fixture(scope="module")
def faults():
    """benchmarks/faults.py's proxy in front of a real `mlflow server` on loopback (sqlite, artifacts over HTTP)."""
    import tempfile
    from pathlib import Path
    module = _faults()
    with tempfile.TemporaryDirectory() as tmp:
        server, port = module.start_server(Path(tmp))
        try:
            yield module, module.FaultProxy(("127.0.0.1", port))
        finally:
            server.terminate()
            server.wait(timeout=30)


@pytest.mark.slow
def test_a_real_server_killed_mid_log_or_answering_503s_keeps_every_run_exactly_once(faults, logged_run_folder,
                                                                                     monkeypatch):
    """The server gone at four points of a variant's logging (its first request, the run's creation, an artifact's
    upload, its last request: applied by the server, the answer lost, nothing after answered), then back: the
    replay leaves the results exactly once, whole. The answer to the run's or the LoggedModel's creation lost with
    the server up: MLflow's client posts it again, and the first log alone leaves them once. Every third request a
    503: the log succeeds through MLflow's retries. (benchmarks/faults.py: every request of the log as a kill
    point.)"""
    module, proxy = faults
    repo, plan = logged_run_folder
    monkeypatch.setenv("MLFLOW_TRACKING_URI", proxy.url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")  # retried at once: the count is the subject
    clean = module.one_point(proxy, repo, plan, "clean")
    assert clean["ok"] and clean["first_log"] == "ok", clean
    log, total = clean["log"], clean["requests"]
    create = next(n for n, what, _ in log if what.endswith("/runs/create"))
    upload = next(n for n, what, _ in log if what.startswith("PUT ") and "artifacts" in what)
    for n in (1, create, upload, total):
        row = module.one_point(proxy, repo, plan, f"kill-{n}", kill_at=n)
        assert row["ok"] and row["first_log"] != "ok", (row, log)
    model = next(n for n, what, _ in log if what.endswith("/logged-models"))
    for n in (create, model):  # the answer lost, the server up: MLflow's client posts it again, the server applies it
        row = module.one_point(proxy, repo, plan, f"lost-{n}", kill_at=n, stay_up=True)
        assert row["ok"] and row["first_log"] == "ok", (row, log)
        assert [what for _, what, _ in row["log"]].count(dict((k, w) for k, w, _ in log)[n]) >= 2
    row = module.one_point(proxy, repo, plan, "every-third-503", fail_every=3)
    assert row["ok"] and row["first_log"] == "ok", row
    assert sum(fate == "503" for _, _, fate in row["log"]) >= 3


def test_a_pending_mark_stands_for_its_results_so_another_s_log_does_not_clear_it(tmp_path, monkeypatch, capsys):
    """A queued experiment (DVC_ROOT: the parent repository) fails to log its train@fp32; the workspace's own
    train@fp32, other results, logs fine: the experiment's mark stays, named with its experiment, until those
    results (applied to the workspace) are logged. A mark whose results are gone, from no experiment, is dropped by
    the sync, saying so."""
    cfg = config.MlflowConfig()
    ws, exp = tmp_path / "runs" / "fp32" / "metrics.json", tmp_path / "exp" / "runs" / "fp32" / "metrics.json"
    for path, text in ((ws, '{"imgs_per_s": 100}'), (exp, '{"imgs_per_s": 120}')):
        path.parent.mkdir(parents=True)
        path.write_text(text)

    def down(c, root):
        raise ConnectionError("the server is down")

    monkeypatch.setenv("DVC_EXP_NAME", "bushy-tuba")
    tracking.safely("train@fp32", down, cfg, tmp_path, results_of=(exp,))
    monkeypatch.delenv("DVC_EXP_NAME")
    tracking.safely("train@fp32", lambda c, root: ("r1", True), cfg, tmp_path, results_of=(ws,))
    assert results.pending_line(tmp_path).startswith("1 result(s) are on disk but not in MLflow (train@fp32 of "
                                                     "experiment bushy-tuba)")
    ws.write_text(exp.read_text())  # `dvc exp apply bushy-tuba`, then `ampbench mlflow-sync`
    tracking.safely("train@fp32", lambda c, root: ("r2", True), cfg, tmp_path, results_of=(ws,))
    assert results.pending_line(tmp_path) is None
    gone = tmp_path / "runs" / "bf16" / "metrics.json"  # a variant since removed from params.yaml
    gone.parent.mkdir(parents=True)
    gone.write_text("{}")
    tracking.safely("train@bf16", down, cfg, tmp_path, results_of=(gone,))
    gone.unlink()
    assert results.drop_gone_pending(tmp_path) == [f"train@bf16 ({gone})"]
    assert results.pending_line(tmp_path) is None


@pytest.mark.parametrize("call", ["create_run", "create_logged_model", "create_experiment", "log_outputs"])
def test_a_post_the_server_applied_twice_leaves_one_run_and_one_model(logged_run_folder, tmp_path, monkeypatch,
                                                                      call):
    """MLflow's client retries POSTs: a runs/create or logged-models that the server applied, its answer lost, is
    applied again by the retry, and the log goes on with the second (benchmarks/faults.py's lost answers, over
    HTTP). The first is found by the log's attempt and deleted: one run, one READY LoggedModel, nothing RUNNING.
    An experiment made twice, or a run's output marked twice, is refused by the store the second time: the log
    takes the one made and goes on."""
    repo, plan = logged_run_folder
    store = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    real = getattr(MlflowClient, call)

    def twice(self, *args, **kwargs):
        real(self, *args, **kwargs)  # applied; the answer lost on its way back
        return real(self, *args, **kwargs)
    monkeypatch.setattr(MlflowClient, call, twice)
    rid, new = tracking.log_variant(config.MlflowConfig(log_model=True), repo, repo / "runs" / "fp32", plan, {})
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("ampbench").experiment_id
    assert new and [(r.info.run_id, r.info.status) for r in client.search_runs([exp])] == [(rid, "FINISHED")]
    assert [(m.source_run_id, m.status.name) for m in client.search_logged_models([exp])] == [(rid, "READY")]
