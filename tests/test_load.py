"""What a loaded team server's clients are told, without a server: a request MLflow's client gave up on, said as its
cause in one line; a database that takes no connection, named with its fix before `ampbench team-server` starts;
the load benchmark's copies of one machine's results, each a machine with keys of its own."""

from __future__ import annotations

import json

import pytest
import yaml
from mlflow.exceptions import MlflowException

from ampbench.errors import NotTheAnalysis
from ampbench.tracking import access, file_key
from ampbench.tracking.server import database_problem

URL = "https://tracking:5000/api/2.0"


def _gave_up(url: str, why: str) -> MlflowException:
    """What MLflow's HTTP client raises once its retries are spent (rest_utils.http_request)."""
    return MlflowException(f"API request to {url} failed with exception HTTPSConnectionPool(host='tracking', "
                           f"port=5000): Max retries exceeded with url: {url.split('5000', 1)[1]} (Caused by {why})")


@pytest.mark.parametrize(("err", "said"), [
    (_gave_up(f"{URL}/mlflow/runs/search", "NewConnectionError(\"HTTPSConnection(host='tracking', port=5000): "
                                           "Failed to establish a new connection: [Errno 111] Connection refused\")"),
     "the server did not answer (connection refused after 3 retries): is it running?"),
    (_gave_up(f"{URL}/mlflow/runs/log-batch", "ProtocolError('Connection aborted.', RemoteDisconnected('Remote end "
                                              "closed connection without response'))"),
     "the server closed the connection mid-request after 3 retries (it stopped or restarted?)"),
    (_gave_up(f"{URL}/mlflow-artifacts/artifacts/1/abc/artifacts/report.md", "ResponseError('too many 500 error "
                                                                              "responses')"),
     "the server could not store report.md (HTTP 500 after 3 retries): is its artifact disk full or not writable? "
     "its log says which"),
    (_gave_up(f"{URL}/mlflow-artifacts/artifacts/1/abc/artifacts/history.csv", "ProtocolError('Connection aborted.', "
              "ConnectionResetError(104, 'Connection reset by peer'))"),  # a full disk can cut the upload instead
     "the server closed the connection while storing history.csv after 3 retries: did it stop, or is its artifact "
     "disk full or not writable? its log says which"),
    (_gave_up(f"{URL}/mlflow/runs/create", "ResponseError('too many 503 error responses')"),
     "the server answered HTTP 503 to /api/2.0/mlflow/runs/create after 3 retries: is its database up? its log "
     "says why"),
])
def test_a_request_mlflow_gave_up_on_is_said_as_its_cause_in_one_line(monkeypatch, err, said):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    assert access.describe(err) == said
    try:  # a LoggedModel's failure reaches the warning wrapped, its own text cut at 300 characters
        raise NotTheAnalysis(str(err)[:300]) from err
    except NotTheAnalysis as wrapped:
        assert access.describe(wrapped) == said
    assert access.gave_up(RuntimeError("disk full")) is None  # any other error: its own first line, as before


def test_a_database_that_takes_no_connection_is_named_with_its_fix():
    import socket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    problem = database_problem(f"postgresql://mlflow:s3cret-pw@127.0.0.1:{port}/mlflow", timeout=2)
    assert "Connection refused" in problem and problem.endswith("start it, or point the URI at the database that runs")
    assert "s3cret-pw" not in problem and "\n" not in problem
    assert database_problem("sqlite:///mlflow.db") is None  # a file: nothing to reach


def test_each_copy_of_the_results_is_a_machine_with_keys_of_its_own(tmp_path):
    from tests.test_team import LOAD
    src = tmp_path / "made"
    (src / "reports" / "runs" / "fp32").mkdir(parents=True)
    (src / "reports" / "env.json").write_text(json.dumps({"cpu_model": "AMD EPYC"}))
    (src / "reports" / "runs" / "fp32" / "metrics.json").write_text('{"env_fingerprint": "CPU AMD EPYC | torch x"}')
    (src / "reports" / "summary.json").write_text("{}")
    (src / "reports" / "report.md").write_text("# On AMD EPYC\n")
    (src / "params.yaml").write_text(yaml.safe_dump({"mlflow": {"experiment": "ampbench", "log_model": True}}))
    one, two = (LOAD.as_machine(src, tmp_path / n, f"Machine {n}", "load") for n in ("1", "2"))
    assert [k[0] for k in one] == ["train@fp32", "report"] and not {k[1] for k in one} & {k[1] for k in two}
    assert one[0][1] == file_key(tmp_path / "1" / "reports" / "runs" / "fp32" / "metrics.json")
    assert json.loads((tmp_path / "2" / "reports" / "env.json").read_text())["cpu_model"] == "Machine 2"
    assert yaml.safe_load((tmp_path / "2" / "params.yaml").read_text())["mlflow"]["experiment"] == "load"
    assert one[0][2] is False  # no model.pt in the folder: no LoggedModel due


def test_mlflow_sync_waits_out_a_server_restart_unless_the_user_set_the_retries(tmp_mlflow, tmp_path, monkeypatch):
    """A stage gives up after 3 retries (seconds): its results are on disk. `ampbench mlflow-sync` replays what an
    outage left, so it retries 6 times (about a minute: a team server restarts in 15 to 30 s,
    benchmarks/results/load.md), unless MLFLOW_HTTP_REQUEST_MAX_RETRIES was the user's own."""
    import argparse
    import os

    from ampbench import cli, tracking
    args = argparse.Namespace(params=str(tmp_path / "params.yaml"), reports=str(tmp_path / "reports"))
    (tmp_path / "params.yaml").write_text("mlflow: {}\n")
    for given, expected in ((False, "6"), (True, "3")):
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
        monkeypatch.setattr(tracking, "RETRIES_GIVEN", given)
        cli.mlflow_sync(args)
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == expected
