"""Bad input, generated, at scale: every input a user hands over, through the code that reads it; each accepted, or
refused in one line naming what is wrong and the fix; never a traceback, never a half-written file.

    python benchmarks/fuzz.py                                  # about 12 minutes on 2 cores: benchmarks/results/fuzz.md
    python benchmarks/fuzz.py --examples 200 --folders 20 --archives 20 --weights 20 --server 1 --out /tmp/fuzz.md

- params.yaml: hypothesis's edits (tests/params_edits.py: every key of the schema, misspelled and unknown keys, YAML
  oddities up to a 10 MB value), each through the env_check stage in this process (tests/outcomes.py: the property
  the suite's test_fuzz checks on a few hundred).
- an image folder (data.source: folder): two good classes and bad images of each kind (benchmarks/fuzz_files.py),
  through the env_check stage, then the data stage (decoded, or listed for streaming); the prepared set is absent
  or loads whole.
- a CIFAR-10 archive (tests' own, in CIFAR's format) cut at a random offset, its MD5 given: the data stage.
- a model.weights file for small_cnn (truncated, another architecture, an arbitrary pickle, a mangled state dict):
  the env_check stage, which loads it; unpickling it unsafely would create a marker file.
- an MLflow tracking server answering garbage (benchmarks/fuzz_server.py): the env_check stage's tracking check
  and `ampbench mlflow-sync` of a trained run, each in its own process with a timeout.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # the suite's helpers: tests/params_edits.py, tests/outcomes.py

import fuzz_files  # noqa: E402  beside this module
import fuzz_server  # noqa: E402
import yaml  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from ampbench import data  # noqa: E402
from ampbench.sandbox import env_with_venv, merge  # noqa: E402
from tests import outcomes, params_edits  # noqa: E402
from tests.conftest import SHRINK, make_cifar_archive  # noqa: E402  (sets XDG_CACHE_HOME: a roofline cache of its own)

BASE = merge(yaml.safe_load((REPO_ROOT / "params.yaml").read_text()), SHRINK)
VERDICTS = ("accepted", "refused", "bug")


class Tally:
    """Per kind of input and per variety: tried, accepted, refused in one line, bugs (with the first few)."""

    def __init__(self):
        self.rows: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.bugs: list[tuple[str, str, str]] = []
        self.said: dict[str, str] = {}  # a refusal's line, for each kind
        self.seconds: collections.Counter = collections.Counter()

    def add(self, kind: str, varieties: list[str], outcome: outcomes.Outcome, what: str) -> None:
        for variety in dict.fromkeys(varieties):
            self.rows[(kind, variety)]["tried"] += 1
            self.rows[(kind, variety)][outcome.verdict] += 1
        if outcome.verdict == "refused" and (kind not in self.said or len(self.said) % 7 == 0):
            self.said[kind] = outcome.line
        if outcome.verdict == "bug":
            self.bugs.append((kind, what, outcome.why()))
            print(f"  BUG {kind}: {what[:200]} -> {outcome.why()[:300]}", flush=True)


def fuzz_params(n: int, tally: Tally, max_value_bytes: int) -> None:
    if n < 1:
        return

    @settings(max_examples=n, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(edit=params_edits.edits(BASE, max_value_bytes))
    def one(edit):
        outcome = outcomes.env_check(edit.text, edit.keys)
        tally.add("params.yaml", [edit.kind], outcome, f"{edit.kind} of {edit.keys}: {edit.text[:160]!r}")
    one()


def _params(**sections) -> bytes:
    return yaml.safe_dump(merge(BASE, sections)).encode()


def _data_stage(root: Path) -> outcomes.Outcome:
    """The data stage as DVC runs it, in ``root``; the prepared set absent, or whole (it loads), no temporary left."""
    argv = ["data.py", "--params", "params.yaml", "--out", "data/prepared", "--raw", "data/raw"]
    if (root / "reports" / "data_source.json").is_file():  # env_check ran: how to prepare the set
        argv += ["--data-source", "reports/data_source.json"]
    outcome = outcomes.run_stage(outcomes.stage("data").main, argv, root)
    prepared = root / "data" / "prepared"
    left = [p.name for p in (root / "data").glob(".*")] + [p.name for p in (root / "data" / "raw").glob("*")
                                                           if p.is_dir()]
    if left:
        outcome.problems.append(f"temporaries left: {left}")
    if outcome.verdict == "accepted":
        here = Path.cwd()
        try:
            os.chdir(root)  # a folder's data.path is relative to the repository, as DVC runs the stages
            meta = data.load_prepared(prepared, "cpu", stream=True)["meta"]
            assert meta["train_count"] > 0 and meta["test_count"] > 0, meta
        except Exception as err:
            outcome.problems.append(f"the prepared set does not load whole ({type(err).__name__}: {err})")
        finally:
            os.chdir(here)
    elif prepared.exists():
        outcome.problems.append("a refused data stage left data/prepared")
    if outcome.problems:
        outcome.verdict = "bug"
    return outcome


def fuzz_folders(n: int, tally: Tally, rng: random.Random) -> None:
    for i in range(n):
        kinds = rng.sample(fuzz_files.IMAGE_KINDS, rng.randint(1, 3))
        with tempfile.TemporaryDirectory(prefix="ampbench-fuzz-") as tmp:
            root = Path(tmp)
            fuzz_files.bad_folder(root / "images", kinds, rng)
            text = _params(data={"source": "folder", "path": "images", "image_size": 16, "workers": 0,
                                 "bad_files": rng.choice(["skip", "stop"]),
                                 "placement": rng.choice(["auto", "stream"])})
            outcome = outcomes.env_check(text, ["data.path", "data.bad_files"], root)
            if outcome.verdict == "accepted":
                outcome = _data_stage(root)
            tally.add("image folder", kinds, outcome, f"folder #{i} with {kinds}")


def fuzz_archives(n: int, tally: Tally, rng: random.Random) -> None:
    with tempfile.TemporaryDirectory(prefix="ampbench-fuzz-") as tmp:
        whole = make_cifar_archive(Path(tmp), per_batch=20, test_count=20)[0].read_bytes()
    cuts = [len(whole)] + [len(whole) - k for k in range(1, 9)] + [0, 1, 10, 512]
    for i in range(n):
        cut = cuts[i] if i < len(cuts) else rng.randrange(len(whole))
        blob = whole[:cut]
        with tempfile.TemporaryDirectory(prefix="ampbench-fuzz-") as tmp:
            root = Path(tmp)
            (root / "cifar.tar.gz").write_bytes(blob)
            (root / "params.yaml").write_bytes(_params(data={"source": "cifar10", "archive": "cifar.tar.gz",
                                                             "md5": hashlib.md5(blob).hexdigest()}))
            outcome = _data_stage(root)
            variety = "whole (the control)" if cut == len(whole) else "cut in its last 8 bytes" \
                if cut > len(whole) - 9 else "cut at a random offset"
            tally.add("CIFAR-10 archive", [variety], outcome, f"cut at {cut} of {len(whole)} bytes")


def fuzz_weights(n: int, tally: Tally, rng: random.Random) -> None:
    for i in range(n):
        kind = fuzz_files.WEIGHT_KINDS[i % len(fuzz_files.WEIGHT_KINDS)]
        with tempfile.TemporaryDirectory(prefix="ampbench-fuzz-") as tmp:
            root = Path(tmp)
            marker = root / "UNPICKLED"
            fuzz_files.weights_file(root / "weights.pt", kind, rng, marker)
            outcome = outcomes.env_check(_params(model={"weights": "weights.pt"}), ["model.weights"], root)
            if marker.exists():
                outcome.verdict = "bug"
                outcome.problems.append("the file was unpickled unsafely: its object ran")
            tally.add("model.weights", [kind], outcome, f"{kind} #{i}")


def _subprocess(argv: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int, str, str]:
    try:
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as err:
        return -9, str(err.stdout or ""), f"timed out after {timeout:g} s"


def trained_repo(root: Path) -> Path:
    """A folder holding one trained small CNN run (env_check, data, train stages; MLflow off), for mlflow-sync."""
    (root / "params.yaml").write_bytes(_params(mlflow={"enabled": False}, variants={"fp32": {"precision": "fp32"}}))
    py, stages = sys.executable, REPO_ROOT / "stages"
    for argv in ([py, stages / "env_check.py", "--params", "params.yaml", *(a for kv in outcomes.OUTPUTS.items()
                                                                             for a in kv)],
                 [py, stages / "data.py", "--params", "params.yaml", "--out", "data/prepared", "--raw", "data/raw"],
                 [py, stages / "train.py", "--plan", "reports/plans/fp32.json", "--data", "data/prepared", "--env",
                  "reports/env.json", "--out", "reports/runs/fp32", "--checkpoints", "checkpoints/fp32"]):
        subprocess.run([str(a) for a in argv], cwd=root, env=env_with_venv(), check=True, capture_output=True)
    (root / "params.yaml").write_bytes(_params(variants={"fp32": {"precision": "fp32"}}))  # MLflow on for the sync
    return root


def _judge_sync(code: int, out: str, err: str) -> outcomes.Outcome:
    """mlflow-sync: exit 0, or exit 1 with each failed log one warning line; no traceback, no timeout."""
    failed = [line for line in out.splitlines() if line.startswith("warning: MLflow logging of ")]
    if "Traceback" in out + err or code not in (0, 1) or (code == 1 and not failed):
        return outcomes.Outcome("bug", code, out, err, trace=err[-3000:] or out[-3000:])
    return outcomes.Outcome("accepted" if code == 0 else "refused", code, out, failed[0] if failed else err)


def fuzz_server_answers(n: int, tally: Tally, timeout: float) -> None:
    with tempfile.TemporaryDirectory(prefix="ampbench-fuzz-") as tmp:
        repo = trained_repo(Path(tmp))
        for answer in fuzz_server.ANSWERS:
            for i in range(n):
                with fuzz_server.Garbage(answer, seed=i) as server:
                    env = {**env_with_venv(), "MLFLOW_TRACKING_URI": server.url}
                    argv = [sys.executable, str(REPO_ROOT / "stages" / "env_check.py"), "--params", "params.yaml",
                            *(a for kv in outcomes.OUTPUTS.items() for a in kv)]
                    code, out, err = _subprocess(argv, repo, env, timeout)
                    outcome = outcomes.judge(code, out, err, err if code == -9 else "")
                    tally.add("tracking server: env_check", [answer], outcome, f"{answer} #{i}")
                    code, out, err = _subprocess([sys.executable, "-m", "ampbench.cli", "mlflow-sync"], repo, env,
                                                 timeout)
                    tally.add("tracking server: mlflow-sync", [answer], _judge_sync(code, out, err), f"{answer} #{i}")


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else ""
    return f"{model or platform.machine()}, {os.cpu_count()} cores (nproc {len(os.sched_getaffinity(0))})"


def page(tally: Tally, command: str, started: datetime.datetime, memory_gib: int) -> str:
    import hypothesis
    import mlflow
    import PIL
    import torch
    lines = ["# Bad input, generated: what each input a user hands over does to ampbench", "",
             f"`{command}` on {started:%Y-%m-%d} ({machine()}; Python {platform.python_version()}, torch "
             f"{torch.__version__}, Pillow {PIL.__version__}, PyYAML {yaml.__version__}, hypothesis "
             f"{hypothesis.__version__}, MLflow {mlflow.__version__}). Each input goes through the code that reads it "
             "(the stage's own `main`, as `run_cli` runs it, or the command in a process of its own). **refused** "
             "is a user error's exit code with one `error:` line naming the key (or file) and the fix (mlflow-sync: "
             "exit 1, one warning line per failed log); **bugs** are a traceback, a refusal of several lines or of "
             "none, a key not named, an output half-written or changed by a refusal, a number accepted that is not "
             "finite, a hang. An input of several varieties counts in each of their rows."
             + (f" The run's address space is capped at {memory_gib} GiB (--memory-gib)." if memory_gib else ""), ""]
    for kind in dict.fromkeys(k for k, _ in tally.rows):
        rows = {v: c for (k, v), c in tally.rows.items() if k == kind}
        total = sum((c for c in rows.values()), collections.Counter())
        both = ", both commands" if kind.startswith("tracking server") else ""
        lines += [f"## {kind} ({tally.seconds[kind]:.0f} s{both})", "",
                  "| input | tried | accepted | refused in one line | bugs |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {v} | {c['tried']} | {c['accepted']} | {c['refused']} | {c['bug']} |"
                  for v, c in sorted(rows.items(), key=lambda vc: -vc[1]["tried"])]
        if len(rows) > 1 and kind != "image folder":
            lines.append(f"| **all** | {total['tried']} | {total['accepted']} | {total['refused']} | {total['bug']} |")
        lines += ["", f"A refusal: `{tally.said[kind][:300]}`" if kind in tally.said else "No refusal.", ""]
    lines += ["## Bugs left", ""] + ([f"- {k}: {what[:300]} -> `{why[:300]}`" for k, what, why in tally.bugs[:40]]
                                     or ["None."]) + [""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=2000, help="params.yaml edits (hypothesis examples)")
    ap.add_argument("--max-value-bytes", type=int, default=10_000_000, help="the largest value a params edit writes")
    ap.add_argument("--folders", type=int, default=300, help="image folders, one to three bad kinds each")
    ap.add_argument("--archives", type=int, default=300, help="CIFAR-10 archives, each cut somewhere")
    ap.add_argument("--weights", type=int, default=600, help="model.weights files")
    ap.add_argument("--server", type=int, default=2, help="runs of each command per kind of garbage answer")
    ap.add_argument("--timeout", type=float, default=120, help="seconds a command may take against the server")
    ap.add_argument("--memory-gib", type=int, default=16, help="address space this process and its commands may take "
                    "(an input that would take the machine's memory fails here, not by the kernel's OOM killer)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "fuzz.md"))
    args = ap.parse_args()
    started, tally, rng = datetime.datetime.now(), Tally(), random.Random(args.seed)
    if args.memory_gib:
        resource.setrlimit(resource.RLIMIT_AS, (args.memory_gib << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    for kind, run in [("params.yaml", lambda: fuzz_params(args.examples, tally, args.max_value_bytes)),
                      ("image folder", lambda: fuzz_folders(args.folders, tally, rng)),
                      ("CIFAR-10 archive", lambda: fuzz_archives(args.archives, tally, rng)),
                      ("model.weights", lambda: fuzz_weights(args.weights, tally, rng)),
                      ("tracking server", lambda: fuzz_server_answers(args.server, tally, args.timeout))]:
        t0 = time.perf_counter()
        print(f"[fuzz] {kind} ...", flush=True)
        run()
        for k in {k for k, _ in tally.rows if k.startswith(kind)}:
            tally.seconds[k] = time.perf_counter() - t0
    command = "python benchmarks/fuzz.py" + "".join(f" {a}" for a in sys.argv[1:])
    text = page(tally, command, started, args.memory_gib)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
