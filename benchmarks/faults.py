"""Fault injection against a real MLflow server: a variant's logging cut at every request it makes, then replayed.

    python benchmarks/faults.py                      # every kill point and the 503 run: faults.md and faults.json
    python benchmarks/faults.py --points 4 --out /tmp/faults

An `mlflow server` (sqlite store, artifacts served over HTTP, on loopback) sits behind a proxy that counts the
client's HTTP requests. For each kill point n, a trained small CNN's run folder is logged (``tracking.log_variant``,
what a train stage and `ampbench mlflow-sync` call) with the server "killed" at request n: the request reaches the
server, which applies it, but its answer never comes back, and every request after it finds the connection closed
(the server down, MLflow's retries spent). The server is then "restarted" (the proxy passes again) and the replay
runs. Each point is cut a second way: the answer to request n lost while the server stays up (a connection reset
on the way back), so MLflow's client, which retries every request, POSTs included, sends it again and the server
applies it twice (a second run, a second LoggedModel, a batch of metrics again). Each point must end with the
results in the store exactly once: one run, FINISHED, keyed, with its metrics, artifacts and a READY LoggedModel,
nothing partial or RUNNING left. A last run answers every third request with a 503 (a proxy or load balancer in
trouble): the log must succeed without a failure, through MLflow's own retries.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "src"))


class FaultProxy(http.server.ThreadingHTTPServer):
    """An HTTP proxy to ``upstream`` that counts requests; ``kill_at``: the request whose answer is lost and after
    which every connection is closed unanswered, until ``restart()`` (with ``stay_up``, only that answer is lost);
    ``fail_every``: every such request answered 503 without reaching the server."""

    daemon_threads = True

    def __init__(self, upstream: tuple[str, int]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream, self.lock = upstream, threading.Lock()
        self.count, self.kill_at, self.fail_every, self.down, self.log = 0, 0, 0, False, []
        self.stay_up = False
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def arm(self, kill_at: int = 0, fail_every: int = 0, stay_up: bool = False) -> None:
        with self.lock:
            self.count, self.kill_at, self.fail_every, self.down, self.log = 0, kill_at, fail_every, False, []
            self.stay_up = stay_up

    def restart(self) -> None:
        self.arm()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _any(self) -> None:
        p: FaultProxy = self.server  # type: ignore[assignment]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with p.lock:
            if p.down:
                self.close_connection = True  # the server is gone: nothing answers
                return
            p.count += 1
            n, what = p.count, f"{self.command} {self.path.split('?')[0]}"
            lose = n == p.kill_at
            fail = bool(p.fail_every) and n % p.fail_every == 0
            p.log.append((n, what, "lost" if lose else "503" if fail else "ok"))
            if lose:
                p.down = not p.stay_up
        if fail:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        conn = http.client.HTTPConnection(*p.upstream, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        conn.request(self.command, self.path, body=body, headers=headers)
        answer = conn.getresponse()
        data = answer.read()
        conn.close()
        if lose:  # applied by the server, its answer lost with it
            self.close_connection = True
            return
        self.send_response(answer.status)
        for k, v in answer.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: Path) -> tuple[subprocess.Popen, int]:
    """`mlflow server` on a sqlite store in ``folder``, artifacts served over HTTP; once /health answers."""
    from ampbench import tracking
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                               f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination",
                               str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers",
                               "1"], cwd=folder,
                              env={**tracking.server_env(), tracking.JOBS_ENV: "false"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server, port
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                raise RuntimeError("mlflow server did not start") from None
            time.sleep(0.3)


def run_folder(folder: Path) -> tuple[Path, dict]:
    """A trained variant's run folder (small_cnn, one epoch of 64 images) with its model; (repo, plan dict)."""
    from ampbench import config, data, results, runplan
    from ampbench.train import runner
    data.prepare(config.DataConfig(source="synthetic", train_size=64, test_size=32), 0, folder / "prepared",
                 folder / "raw")
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "small_cnn"},
                            "train": {"epochs": 1, "batch_size": 32, "warmup_steps": 1}, "profile": {"steps": 0},
                            "variants": {"fp32": {"precision": "fp32"}}})
    plan = runplan.make_plan(cfg, "fp32", "cpu")
    prepared = data.load_prepared(folder / "prepared", "cpu")
    result = runner.train(plan, prepared, progress=False)
    result.metrics["dataset"] = data.record(folder / "prepared", prepared["meta"])
    model = {"state_dict": result.weights, "model": config.to_dict(plan.model), "num_classes": 10, "image_size": 32,
             "precision": "fp32"}
    results.write_run(folder / "runs" / "fp32", result.metrics, result.tables(), result.step_times_ms, "", model)
    return folder, config.to_dict(plan)


def stored(uri: str, experiment: str) -> dict:
    """What the store holds of an experiment: its runs (status, keyed), their artifacts and LoggedModels."""
    from mlflow.tracking import MlflowClient

    from ampbench import tracking
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {"runs": []}
    runs = client.search_runs([exp.experiment_id])
    models = client.search_logged_models([exp.experiment_id])
    return {"runs": [{"id": r.info.run_id, "status": r.info.status, "keyed": tracking.KEY_TAG in r.data.tags,
                      "metrics": len(r.data.metrics),
                      "artifacts": sorted(a.path for a in client.list_artifacts(r.info.run_id))} for r in runs],
            "models": [(m.source_run_id, m.status.name) for m in models]}


def whole(found: dict, rid: str) -> str:
    """"" when the store holds the results exactly once and whole; else what is wrong."""
    runs = found["runs"]
    if len(runs) != 1:
        return f"{len(runs)} runs"
    r = runs[0]
    if r["id"] != rid or r["status"] != "FINISHED" or not r["keyed"]:
        return f"run {r['status']}, keyed {r['keyed']}"
    if not {"metrics.json", "history.csv", "system.csv"} <= set(r["artifacts"]) or r["metrics"] < 10:
        return f"artifacts {r['artifacts']}, {r['metrics']} metrics"
    if found["models"] != [(rid, "READY")]:
        return f"LoggedModels {found['models']}"
    return ""


def one_point(proxy: FaultProxy, repo: Path, plan: dict, experiment: str, kill_at: int = 0,
              fail_every: int = 0, stay_up: bool = False) -> dict:
    """Log the run folder with the fault armed, then (the server back) replay it; the outcome, as a row."""
    from ampbench import config, tracking
    cfg, run_dir = config.MlflowConfig(experiment=experiment, log_model=True), repo / "runs" / "fp32"
    proxy.arm(kill_at=kill_at, fail_every=fail_every, stay_up=stay_up)
    first_error = ""
    try:
        tracking.log_variant(cfg, repo, run_dir, plan, {})
    except Exception as err:  # the server went away: what a stage's `safely` would warn of
        first_error = type(err).__name__
    where = next((what for n, what, fate in proxy.log if fate == "lost"), "")
    requests, first_log = proxy.count, list(proxy.log)
    proxy.restart()
    rid, _ = tracking.log_variant(cfg, repo, run_dir, plan, {})  # what `ampbench mlflow-sync` runs
    again = tracking.log_variant(cfg, repo, run_dir, plan, {})
    problem = whole(stored(proxy.url, experiment), rid) or ("" if again == (rid, False) else "logged twice")
    return {"kill_at": kill_at, "fail_every": fail_every, "stay_up": stay_up, "request": where, "requests": requests,
            "first_log": first_error or "ok", "ok": not problem, "problem": problem, "log": first_log}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", type=int, default=0, help="kill points, spread over the requests (0: every one)")
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "faults"))
    args = ap.parse_args()
    os.environ.update(MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="0", MLFLOW_HTTP_REQUEST_BACKOFF_JITTER="0")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        server, port = start_server(folder)
        try:
            proxy = FaultProxy(("127.0.0.1", port))
            os.environ["MLFLOW_TRACKING_URI"] = proxy.url
            repo, plan = run_folder(folder / "repo")
            clean = one_point(proxy, repo, plan, "faults-clean")
            total = clean["requests"]
            points = range(1, total + 1) if not args.points else sorted(
                {1 + round(i * (total - 1) / max(args.points - 1, 1)) for i in range(args.points)})
            rows = [clean]
            for i, n in enumerate(points, 1):
                for stay_up in (False, True):
                    rows.append(one_point(proxy, repo, plan, f"faults-{n}{'-up' if stay_up else ''}", kill_at=n,
                                          stay_up=stay_up))
                    print(f"[faults {i}/{len(points)}] request {n} of {total} ({rows[-1]['request']}), server "
                          f"{'up' if stay_up else 'down'}: {'ok' if rows[-1]['ok'] else rows[-1]['problem']}",
                          flush=True)
            rows.append(one_point(proxy, repo, plan, "faults-503", fail_every=3))
            print(f"[faults] every third request a 503: first log {rows[-1]['first_log']}, "
                  f"{'ok' if rows[-1]['ok'] else rows[-1]['problem']}", flush=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps([{k: v for k, v in r.items() if k != "log"} for r in rows],
                                                   indent=2) + "\n")
    kills = [r for r in rows if r["kill_at"] and not r["stay_up"]]
    lost = [r for r in rows if r["stay_up"]]
    lines = [f"# Fault injection: a variant's logging cut at {len(kills)} of its {total} requests", "",
             f"`python benchmarks/faults.py` (MLflow server on loopback, sqlite store, artifacts over HTTP). "
             f"{sum(r['ok'] for r in kills)} of {len(kills)} kill points (the answer lost, the server down after it) "
             f"replayed to the results exactly once (one run, FINISHED, keyed, its metrics, artifacts and READY "
             f"LoggedModel); {sum(r['ok'] for r in lost)} of {len(lost)} lost answers with the server up (the request "
             f"retried by MLflow's client and applied twice) left them exactly once, "
             f"{sum(r['first_log'] == 'ok' for r in lost)} of them without a failed first log.", "",
             "| request | what it was | server after it | first log | after the replay |", "|---|---|---|---|---|"]
    lines += [f"| {r['kill_at'] or '-'} | {r['request'] or ('every third a 503' if r['fail_every'] else 'no fault')} "
              f"| {('up' if r['stay_up'] else 'down') if r['kill_at'] else '-'} | {r['first_log']} "
              f"| {'whole, once' if r['ok'] else r['problem']} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"faults: {sum(r['ok'] for r in rows)} of {len(rows)} whole -> {out.with_suffix('.md')}")
    if not all(r["ok"] for r in rows) or rows[-1]["first_log"] != "ok":
        sys.exit(1)


if __name__ == "__main__":
    main()
