"""Load on a team server: N machines log at once through `ampbench mlflow-sync` while the server and its database
restart under them, then each syncs again; what the store holds afterwards.

    python benchmarks/load.py                          # N = 4, 8, 16: benchmarks/results/load.md and load.json
    python benchmarks/load.py --writers 4 --out /tmp/load

`ampbench team-server` (basic-auth, TLS, 4 workers) on a throwaway PostgreSQL cluster (Debian's postgresql, as
`make test` installs it). One machine's results (4 variants, each with its model, and a report: one small CPU
`dvc repro`) are copied N times, each copy presenting another machine (its CPU model rewritten, so its runs have
keys of their own), each logged by its own account (`ampbench team-user`). While the N syncs run, the server is
stopped with SIGTERM and started again once, then PostgreSQL is restarted once. Then every writer syncs again (the
replay), writer 1 twice at once (a replay racing another writer of the same results). Each run must end in the
store whole exactly once: its key, FINISHED, its metrics and files, and for a training run its READY LoggedModel.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import teamserver  # noqa: E402, F401  the throwaway team: the team tests reach it through this module
from teamserver import PG_BINS, Cluster, TeamServer, small_params, team_user  # noqa: E402

# a writer: `ampbench mlflow-sync`'s own main, after a line that marks the end of its imports (the first run's clock)
WRITER = ("import sys; from ampbench import cli, tracking; print('imported', flush=True); "
          "sys.argv = ['ampbench', 'mlflow-sync']; cli.main()")
DONE = re.compile(r"^(?:MLflow: (logged|already logged:) (\S+)|warning: MLflow logging of (\S+) failed)")


def results_folder(folder: Path) -> Path:
    """One machine's results: params.yaml's 4 variants, each with its model, and the report, from one small CPU
    `dvc repro` (a small CNN, 64 synthetic images, one epoch; nothing logged)."""
    from ampbench import sandbox
    repo = sandbox.create(folder, small_params(mlflow={"enabled": False, "log_model": True}))
    sandbox.repro(repo)
    return repo


def as_machine(src: Path, dest: Path, name: str, experiment: str) -> list[tuple[str, str, bool]]:
    """A copy of ``src``'s results that another machine (``name``) made: its CPU model rewritten in every file
    that names it, so each run's key (its files' hash) is its own; logging to ``experiment``. The runs it holds:
    (what, key, whether a LoggedModel is due)."""
    import yaml

    from ampbench import results, tracking
    cpu = json.loads((src / "reports" / "env.json").read_text())["cpu_model"].encode()  # the machine that made them
    dest.mkdir(parents=True)
    shutil.copytree(src / "reports", dest / "reports")
    for f in (dest / "reports").rglob("*"):
        if f.suffix in (".json", ".md", ".html") and cpu in (blob := f.read_bytes()):
            f.write_bytes(blob.replace(cpu, name.encode()))
    params = yaml.safe_load((src / "params.yaml").read_text())
    params["mlflow"].update(enabled=True, experiment=experiment, tracking_uri="")
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    r = dest / "reports"
    keys = [(f"train@{m.parent.name}", tracking.file_key(m), params["mlflow"]["log_model"]
             and (m.parent / results.MODEL).is_file()) for m in sorted(r.glob(f"runs/*/{results.METRICS}"))]
    if (r / "summary.json").is_file():
        keys.append(("report", tracking.file_key(r / "summary.json", r / "report.md"), False))
    return keys


class Writer:
    """One machine's `ampbench mlflow-sync` in its folder, each line of its output stamped as it comes."""

    def __init__(self, folder: Path, env: dict):
        self.folder, self.t0 = folder, time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER], cwd=folder, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait(self, timeout: float = 1800) -> int:
        """Its exit code, once it exited; its output kept in its folder (sync-<n>.log)."""
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=30)
        logs = len(list(self.folder.glob("sync-*.log")))
        (self.folder / f"sync-{logs + 1}.log").write_text("".join(f"{t - self.t0:7.2f} {line}\n"
                                                                 for t, line in self.lines))
        return self.proc.returncode

    def done(self) -> list[tuple[str, float, str]]:
        """Each log it finished: (what, seconds since the line before it, new | already | failed)."""
        out, last = [], None
        for t, line in list(self.lines):
            if line == "imported":
                last = t
            elif (m := DONE.match(line)) and last is not None:
                outcome = "failed" if m.group(3) else "new" if m.group(1) == "logged" else "already"
                out.append((m.group(2) or m.group(3), t - last, outcome))
                last = t
        return out

    def warnings(self) -> list[str]:
        return [line for _, line in self.lines if line.startswith(("warning:", "error:", "Traceback"))]


def census(client, experiment: str, machines: dict[str, list[tuple[str, str, bool]]]) -> dict:
    """What the store holds of these machines' runs (machine -> its runs, as ``as_machine`` gives them): the runs
    whole exactly once (the key, FINISHED, metrics, its files, its one READY LoggedModel where one is due),
    the keys with more than one run (duplicates), the runs neither whole nor retired (partial), the retired ones
    (FAILED and tagged; of them, those FINISHED none the less, which `ampbench compare` counts as runs)."""
    from ampbench.tracking import KEY_TAG
    from ampbench.tracking.runkeys import RETIRED_TAG
    exp_id = client.get_experiment_by_name(experiment).experiment_id
    runs = [r for r in client.search_runs([exp_id], max_results=5000) if r.data.tags.get("ampbench.machine")
            in machines]
    ready, token = {}, None
    while True:  # the LoggedModels, a page at a time
        page = client.search_logged_models([exp_id], max_results=100, page_token=token)
        for m in page:
            ready[m.source_run_id] = ready.get(m.source_run_id, 0) + (m.status.name == "READY")
        if not (token := page.token):
            break
    out = {"expected": 0, "whole_once": 0, "duplicates": 0, "missing": []}
    for machine, keys in machines.items():
        for what, key, model in keys:
            mine = [r for r in runs if r.data.tags.get(KEY_TAG) == key and RETIRED_TAG not in r.data.tags]
            files = [{a.path for a in client.list_artifacts(r.info.run_id)} for r in mine]
            whole = [r for r, f in zip(mine, files, strict=True) if r.info.status == "FINISHED" and r.data.metrics
                     and {"metrics.json" if what != "report" else "report.md"} <= f
                     and (ready.get(r.info.run_id) == 1 or not model)]
            out["expected"] += 1
            out["whole_once"] += len(whole) == len(mine) == 1
            out["duplicates"] += max(0, len(mine) - 1)
            if not whole:
                out["missing"].append(f"{machine} {what}: {len(mine)} keyed, none whole")
    retired = [r for r in runs if RETIRED_TAG in r.data.tags]
    out["retired"] = len(retired)
    out["retired_finished"] = sum(r.info.status == "FINISHED" for r in retired)  # `ampbench compare` counts these
    out["partial"] = sum(r.info.status != "FINISHED" or KEY_TAG not in r.data.tags for r in runs
                         if RETIRED_TAG not in r.data.tags)
    return out


def server_answers(log: Path, start: int, end: int | None = None) -> dict[str, int]:
    """The HTTP status of each request uvicorn logged between two offsets of its log, counted by class."""
    codes = re.findall(r'HTTP/[\d.]+" (\d{3})', log.read_bytes()[start:end].decode(errors="replace"))
    return {"requests": len(codes), "5xx": sum(c.startswith("5") for c in codes),
            "4xx": sum(c.startswith("4") for c in codes)}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _wait(cond, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.2)


def _phase(writers: list[Writer]) -> dict:
    """What a set of syncs did: exit codes, runs logged (new, already) and failed, the failures' causes, and the
    seconds each new run's log took (p50, p95)."""
    codes = [w.wait() for w in writers]
    done = [d for w in writers for d in w.done() if d[0].startswith(("train@", "report"))]  # not the ratios
    new = [s for _, s, outcome in done if outcome == "new"]
    causes: dict[str, int] = {}
    for w in writers:
        for line in w.warnings():
            why = line.split(" failed (", 1)[-1].rsplit("); the results", 1)[0] if " failed (" in line else line
            causes[why[:160]] = causes.get(why[:160], 0) + 1
    return {"exit_codes": sorted(codes), "logged_new": len(new), "already": sum(d[2] == "already" for d in done),
            "failed": sum(d[2] == "failed" for d in done), "p50_s": percentile(new, 0.5),
            "p95_s": percentile(new, 0.95), "causes": causes}


def load_round(n: int, server: TeamServer, cluster: Cluster, src: Path, work: Path, accounts: list[tuple[str, str]],
               experiment: str, restart_db: bool = True, twin: bool = True) -> dict:
    """N writers (``accounts[:n]``) log at once; once the server has made a run, it is stopped with SIGTERM and
    started again; once a fifth of the runs are logged after that, PostgreSQL restarts (``restart_db``). Then
    each syncs again (with ``twin``, writer 1 twice at once). What they printed, the faults, and the census (read
    with this process's MLFLOW_TRACKING_USERNAME / PASSWORD: the admin's)."""
    from mlflow.tracking import MlflowClient
    machines, envs = {}, []
    for k, (user, password) in enumerate(accounts[:n]):
        name, folder = f"Load machine {k + 1:02d} of {n}", work / f"n{n}" / f"w{k + 1:02d}"
        machines[name] = as_machine(src, folder, name, experiment)
        envs.append((folder, server.client_env(user, password)))
    offset, peak, stop = server.log.stat().st_size, [0], threading.Event()

    def sample() -> None:  # the server's memory, its process tree's RSS, 4 times a second
        while not stop.wait(0.25):
            peak[0] = max(peak[0], server.rss())
    threading.Thread(target=sample, daemon=True).start()
    t0 = time.monotonic()
    writers = [Writer(folder, env) for folder, env in envs]
    runs = sum(len(keys) for keys in machines.values())

    def progress() -> int:
        return sum(len(w.done()) for w in writers)

    def fault(what: str, act) -> None:
        at, live = time.monotonic() - t0, sum(w.proc.poll() is None for w in writers)
        act()
        faults.append({"what": what, "at_s": at, "writers_running": live, "took_s": time.monotonic() - t0 - at})
    faults: list[dict] = []
    _wait(lambda: b"/runs/create" in server.log.read_bytes()[offset:] or all(w.proc.poll() is not None
                                                                             for w in writers))
    fault("server stopped with SIGTERM, started again", lambda: (server.stop(), server.start()))
    if restart_db:
        back = progress()
        _wait(lambda: progress() >= back + max(1, runs // 5) or all(w.proc.poll() is not None for w in writers))
        fault("PostgreSQL restarted (pg_ctl restart -m fast)", cluster.restart)
    first = _phase(writers)
    first_s, replay_offset = time.monotonic() - t0, server.log.stat().st_size
    replay = _phase([Writer(folder, env) for folder, env in envs + (envs[:1] if twin else [])])
    stop.set()
    found = census(MlflowClient(server.base), experiment, machines)
    return {"writers": n, **found, "first_sync": first, "replay": replay, "faults": faults,
            "first_sync_s": first_s, "total_s": time.monotonic() - t0, "peak_rss_bytes": peak[0],
            "answers_first": server_answers(server.log, offset, replay_offset),
            "answers_replay": server_answers(server.log, replay_offset)}


EXPERIMENT = "load"
NOTES = "\n## What the load found"  # a hand-written section of the page, kept when the figures are written again


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip()
    return (f"`nproc` {os.cpu_count()}, {cpu}; Python {platform.python_version()}, PostgreSQL "
            f"{Path(PG_BINS[-1]).parent.name}; commit {commit}; {time.strftime('%Y-%m-%d')}")


def page(rows: list[dict], command: str, made_s: float, old: str = "") -> str:
    lines = [f"# Load on a team server: {', '.join(str(r['writers']) for r in rows)} machines logging at once", "",
             f"`{command}`: {machine()}. One machine's results (4 variants with their models, and a report: 5 runs, "
             f"made by one CPU `dvc repro` in {made_s:.0f} s) copied per writer, each a machine of its own with its "
             "own account (EDIT). While the writers log, the server is stopped with SIGTERM and started again, then "
             "PostgreSQL is restarted; then each writer syncs again (the replay), writer 1 twice at once. Whole: the "
             "run's key, FINISHED, its metrics and files, and a training run's READY LoggedModel.", "",
             "| writers | runs expected | whole exactly once | duplicates | partial left | retired (of them FINISHED) "
             "| first sync: one run's log p50 / p95 | server peak RSS | first sync: requests, 5xx | server down "
             "(writers running) | "
             "PostgreSQL restart (writers running) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, (down, *db) = r["first_sync"], r["faults"]
        lines.append(f"| {r['writers']} | {r['expected']} | {r['whole_once']} | {r['duplicates']} | {r['partial']} "
                     f"| {r['retired']} ({r['retired_finished']}) | {_s(f['p50_s'])} / {_s(f['p95_s'])} "
                     f"| {r['peak_rss_bytes'] / 2**20:.0f} MiB "
                     f"| {r['answers_first']['requests']}, {r['answers_first']['5xx']} | {down['took_s']:.0f} s at "
                     f"{down['at_s']:.0f} s ({down['writers_running']}) | "
                     + (f"at {db[0]['at_s']:.0f} s ({db[0]['writers_running']})" if db else "-") + " |")
    lines += ["", "What the syncs printed: each cause, and how many runs' logs it stopped.", ""]
    for r in rows:
        for name, p in (("first sync", r["first_sync"]), ("replay", r["replay"])):
            lines.append(f"- {r['writers']} writers, {name}: exit codes {_codes(p['exit_codes'])}; {p['logged_new']} "
                         f"runs logged, {p['already']} found logged, {p['failed']} failed; one run's log p50 / p95 "
                         f"{_s(p['p50_s'])} / {_s(p['p95_s'])}; {r['answers_' + name.split()[0]]['5xx']} 5xx")
            lines += [f"  - {n} x `{why}`" for why, n in sorted(p["causes"].items(), key=lambda kv: -kv[1])]
        lines += [f"  - not whole: {m}" for m in r["missing"]]
    return "\n".join(lines) + "\n" + (old[old.index(NOTES):] if NOTES in old else "")


def _codes(codes: list[int]) -> str:
    return ", ".join(f"{codes.count(c)} x {c}" for c in sorted(set(codes)))


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} s"


def main() -> None:
    import secrets
    from concurrent.futures import ThreadPoolExecutor
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--writers", default="4,8,16", help="how many machines log at once, a round each (4,8,16)")
    ap.add_argument("--workers", type=int, default=4, help="the server's uvicorn workers (team-server's default)")
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "load"))
    ap.add_argument("--results", default="", help="a folder results_folder made before (else one is made)")
    ap.add_argument("--logs", default="", help="a folder to keep the server's log and each sync's output in")
    args = ap.parse_args()
    # the retry settings the writers get, as given here (ampbench.tracking sets its defaults once imported)
    retries = "".join(f"{k}={os.environ[k]} " for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                                                        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR") if k in os.environ)
    if not PG_BINS:
        sys.exit("PostgreSQL is not installed (/usr/lib/postgresql/<version>/bin): `make postgres`")
    ns = [int(n) for n in args.writers.split(",")]
    admin_pw = secrets.token_urlsafe(16)
    accounts = [(f"machine-{k:02d}", secrets.token_urlsafe(16)) for k in range(1, max(ns) + 1)]
    with tempfile.TemporaryDirectory(prefix="ampbench-load-") as tmp:
        work, t0 = Path(tmp), time.monotonic()
        src = Path(args.results) if args.results else results_folder(work / "made")
        made_s = time.monotonic() - t0
        cluster = Cluster(secrets.token_urlsafe(16))
        (work / "server").mkdir()
        server = TeamServer(work / "server", cluster, admin_pw, workers=args.workers)
        try:
            admin = server.client_env("admin", admin_pw)
            team_user(admin, *accounts[0], EXPERIMENT)  # the experiment, made by the admin
            with ThreadPoolExecutor(4) as pool:  # `ampbench team-user` for each other machine, 4 at a time
                list(pool.map(lambda a: team_user(admin, *a, EXPERIMENT), accounts[1:]))
            os.environ.update({k: v for k, v in admin.items() if k.startswith("MLFLOW_TRACKING")})  # the census's
            rows = []
            for n in ns:
                rows.append(load_round(n, server, cluster, src, work, accounts, EXPERIMENT))
                print(json.dumps(rows[-1], indent=1), flush=True)
        finally:
            server.stop()
            cluster.close()
            if args.logs:
                shutil.copytree(work, args.logs, dirs_exist_ok=True, ignore=lambda d, names: [
                    n for n in names if (Path(d) / n).is_file() and not n.endswith(".log")])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    old = out.with_suffix(".md").read_text() if out.with_suffix(".md").is_file() else ""
    command = f"{retries}python benchmarks/load.py {' '.join(sys.argv[1:])}".strip()
    out.with_suffix(".md").write_text(page(rows, command, made_s, old))
    print(f"load: {out.with_suffix('.md')}")
    if any(r["whole_once"] != r["expected"] or r["duplicates"] or r["partial"] or r["retired_finished"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
