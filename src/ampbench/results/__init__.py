"""The files of one training run, ``reports/runs/<variant>/``: written by the train stage, read by the report.

- ``metrics.json``: the run's numbers (DVC metrics)
- ``history.csv``: one row per epoch (DVC plots)
- ``loss_scale.csv``: every change of the fp16 loss scale, with its step
- ``grad_norm.csv``: the gradients' total norm before clipping, per optimizer step (with clipping or
  ``train.log_grad_norm``; a header alone otherwise)
- ``step_times.json``: the timed step times, for the report's confidence intervals
- ``numerics.csv``: the fp16 numerics audit, one row per layer (fp16 variants)
- ``system.csv``: CPU, memory (and GPU) samples taken during training
- ``profile_trace.json``: torch.profiler's trace of the profiled steps (open it in Perfetto or chrome://tracing)

Files are written under a temporary name and renamed, so a reader never sees half a file. What made them is
named here too: the environment's fingerprint, the git commit, and a digest of the source files a stage reaches.
"""

from __future__ import annotations

import ast
import csv
import hashlib
import io
import json
import os
import re
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ampbench.measure.sysmon import COLUMNS as SYSTEM_COLUMNS
from ampbench.results.modes import plain_mode, process_umask  # noqa: F401  where every writer here reads them
from ampbench.results.schema import Env, Metrics  # noqa: F401  the files' schema

PACKAGE = Path(__file__).resolve().parent.parent  # src/ampbench
METRICS, HISTORY, SCALE, STEP_TIMES = "metrics.json", "history.csv", "loss_scale.csv", "step_times.json"
NUMERICS, SYSTEM, TRACE = "numerics.csv", "system.csv", "profile_trace.json"
GRAD_NORM = "grad_norm.csv"
MODEL = "model.pt"  # the final weights (a state dict, with what rebuilds the model): MLflow's LoggedModel, later too
# The sweep's sweep.csv (reports/sweep/), one row per point, for dvc plots
SWEEP_COLUMNS = ["variant", "batch_size", "imgs_per_s", "imgs_per_s_p10", "imgs_per_s_p90", "peak_mem_bytes",
                 "peak_reserved_bytes", "activation_bytes", "achieved_tflops", "oom"]


def fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename into it) to disk, where the system allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # a file system that cannot sync a folder: the rename is still atomic
        pass
    finally:
        os.close(fd)


@contextmanager
def durable(path: Path, prefix: str = "", suffix: str = ""):
    """Yield a temporary file's path beside ``path`` to write; then flush it to disk, give it the plain mode, rename
    it onto ``path`` and flush the folder's entry: after a power loss ``path`` is the old file or the new one, whole.
    A crash leaves at most the temporary (``prefix``, by default ``.<name>.``), which ``remove_temporaries``
    clears at the next start; a failure removes it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix or f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, plain_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def remove_temporaries(folder: Path, prefixes: tuple[str, ...]) -> list[str]:
    """Delete the temporaries a crash left in ``folder`` (files whose names start with one of ``prefixes``); their
    names."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    gone = [f for f in folder.iterdir() if f.is_file() and f.name.startswith(prefixes)]
    for f in gone:
        f.unlink(missing_ok=True)
    return sorted(f.name for f in gone)


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` durably (``durable``)."""
    with durable(path) as tmp:
        tmp.write_text(text)


def write_json(path: Path, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")


def csv_text(rows: list[dict], columns: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _clean(obj):
    """NaN/inf are not JSON: store them as null ("missing"), never as a made-up number."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


@dataclass(frozen=True)
class Table:
    """One CSV file of a run folder."""
    file: str
    columns: tuple[str, ...] = ()  # its columns; () = its rows' own (the first row's keys)
    empty: tuple[str, ...] = ()    # the header it gets with no rows, when its rows give its columns


# the fp16 numerics audit: per layer, whether its parameters are all frozen, and the shares of its activations and of
# the gradients flowing back into it that overflow, flush to zero or land subnormal in fp16 (the gradient columns
# empty where no gradient reaches the layer: frozen layers before the first trained one)
FP16_FRACTIONS = ("overflow", "underflow", "subnormal")
NUMERICS_COLUMNS = ("layer", "type", "autocast_dtype", "values", "frozen",
                    *(f"{kind}_{f}" for kind in ("act", "grad", "grad_scaled") for f in FP16_FRACTIONS))

# A run folder's tables, by the key ``read_run`` gives each (and a run result's ``tables()``). A new per-run table
# is one line here, its rows from what makes them, and a report section that reads ``run[key]``.
TABLES = {
    "history": Table(HISTORY, empty=("epoch",)),                # one row per epoch
    "scale": Table(SCALE, ("step", "scale", "skipped")),        # every loss-scale change
    "grad_norm": Table(GRAD_NORM, ("step", "grad_norm")),       # the gradient norm before clipping, per step
    "numerics": Table(NUMERICS, NUMERICS_COLUMNS),              # the fp16 numerics audit, one row per layer
    "system": Table(SYSTEM, tuple(SYSTEM_COLUMNS)),             # CPU, memory and GPU samples while training
}


def write_run(out_dir: Path, metrics: Metrics, tables: dict[str, list[dict]], step_times_ms: list[float] = (),
              trace: str = "", model: dict | None = None) -> None:
    """A run folder: every table of ``TABLES`` (``tables`` by key; one left out is written empty), the step times,
    the profile's trace, the weights, and metrics.json last (its presence means the run is complete)."""
    unknown = set(tables) - set(TABLES)
    if unknown:
        raise ValueError(f"no run table is called {sorted(unknown)}; add it to results.TABLES")
    out_dir = Path(out_dir)
    remove_temporaries(out_dir, RUN_TEMPORARIES)
    if model is not None:
        import torch
        with durable(out_dir / MODEL, prefix=".model.", suffix=".pt") as tmp:
            torch.save(model, tmp)
    atomic_write(out_dir / TRACE, trace or '{"traceEvents": []}\n')  # an empty trace when profiling is off
    for key, table in TABLES.items():
        rows = list(tables.get(key) or ())
        columns = table.columns or (tuple(rows[0]) if rows else table.empty)
        atomic_write(out_dir / table.file, csv_text(rows, list(columns)))
    write_json(out_dir / STEP_TIMES, [round(t, 4) for t in step_times_ms])
    write_json(out_dir / METRICS, _clean(metrics))  # last: its presence means the run is complete


# the temporaries a crash mid-write can leave in a run folder (``durable``'s names for its files)
RUN_TEMPORARIES = (".model.", *(f".{name}." for name in (METRICS, STEP_TIMES, TRACE,
                                                         *(t.file for t in TABLES.values()))))


PENDING_DIR = Path(".ampbench") / "mlflow-pending"  # logs that failed, under the repository: no stage's DVC dependency


def pending_marker(root: Path, what: str, results_of: tuple[Path, ...] = ()) -> Path:
    """The marker a failed MLflow log of ``what`` leaves in the repository ``root`` until a log of the same results
    succeeds: named by the results (``results_of``: the bytes of the files that identify them, wherever they are),
    not only the stage. A queued experiment's train@fp32 and the workspace's are two marks, and logging one clears
    its own alone; the experiment's clears once its results, applied to the workspace, are logged."""
    name = re.sub(r"[^\w@.-]+", "-", what)
    if results_of:
        h = hashlib.sha256()
        for path in results_of:
            h.update(Path(path).read_bytes() if Path(path).is_file() else b"")
            h.update(b"\0")
        name += "-" + h.hexdigest()[:12]
    return Path(root) / PENDING_DIR / (name + ".txt")


def write_pending(marker: Path, what: str, why: str, results_of: tuple[Path, ...] = ()) -> None:
    """The marker's lines: what, why, where its results are, and the DVC experiment that made them (if one did)."""
    lines = [what, why, "files: " + json.dumps([str(Path(p).resolve()) for p in results_of])]
    if os.environ.get("DVC_EXP_NAME"):
        lines.append(f"experiment: {os.environ['DVC_EXP_NAME']}")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("\n".join(lines) + "\n")


def _pending(root: Path) -> list[tuple[Path, str, list[str], str]]:
    """Every marker: (its file, what, its results' files, the experiment or "")."""
    folder = Path(root) / PENDING_DIR
    out = []
    for f in sorted(folder.glob("*.txt")) if folder.is_dir() else []:
        lines = f.read_text().splitlines()
        files = next((json.loads(x[7:]) for x in lines if x.startswith("files: ")), [])
        exp = next((x[12:] for x in lines if x.startswith("experiment: ")), "")
        out.append((f, lines[0] if lines else f.stem, files, exp))
    return out


def pending_line(root: Path) -> str | None:
    """What is on disk but not in MLflow (the logs that failed, and no sync has done since), as env_check and the
    report stage say it; None when nothing is."""
    marks = _pending(root)
    waiting = [what + (f" of experiment {exp}" if exp else "") for _, what, _, exp in marks]
    if not waiting:
        return None
    return (f"{len(waiting)} result(s) are on disk but not in MLflow ({', '.join(waiting)}): log them with "
            "`ampbench mlflow-sync`" + (" (an experiment's after `dvc exp apply`)" if any(m[3] for m in marks)
                                        else ""))


def drop_gone_pending(root: Path) -> list[str]:
    """Remove the marks whose results are gone from disk and came from no DVC experiment (a variant since removed):
    nothing is left to log. An experiment's stay: `dvc exp apply` brings its results back. Returns what went."""
    gone = []
    for f, what, files, exp in _pending(root):
        if files and not exp and not any(Path(p).exists() for p in files):
            f.unlink(missing_ok=True)
            gone.append(f"{what} ({files[0]})")
    return gone


def read_run(run_dir: Path) -> dict:
    """One run: its metrics, each table of ``TABLES`` under its key (rows as dicts of strings; [] where the
    file is absent) and its step times."""
    run_dir = Path(run_dir)
    out = {"metrics": json.loads((run_dir / METRICS).read_text()), "step_times_ms": []}
    for key, table in TABLES.items():
        out[key] = []
        if (run_dir / table.file).is_file():
            with open(run_dir / table.file) as f:
                out[key] = list(csv.DictReader(f))
    if (run_dir / STEP_TIMES).is_file():
        out["step_times_ms"] = json.loads((run_dir / STEP_TIMES).read_text())
    return out


def read_runs(runs_dir: Path) -> dict[str, dict]:
    """All complete runs under ``runs_dir`` (those with a metrics.json), by variant name."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        return {}
    return {d.name: read_run(d) for d in sorted(runs_dir.iterdir()) if (d / METRICS).is_file()}


def fingerprint(info: dict) -> str:
    """A short, stable name for the environment, used as an MLflow tag."""
    gpu = info.get("gpu")
    where = f"{gpu['name']} sm{gpu['capability']}" if gpu else f"CPU {info.get('cpu_model', 'unknown')}"
    return f"{where} | torch {info.get('torch', 'unknown')} | CUDA {info.get('cuda_runtime')}"


def git_commit(where: Path | None = None) -> str:
    """The commit of the ampbench code that ran (``-dirty`` if it has uncommitted changes)."""
    where = where or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def _module_file(module: str) -> Path | None:
    base = PACKAGE.parent / Path(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _ampbench_imports(path: Path) -> set[Path]:
    """The files of the ampbench modules ``path`` imports (function-level imports too, and modules named in full
    in a string, as a registry loads them), and their packages."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and re.fullmatch(r"ampbench(\.\w+)+", node.value):
            names = [node.value]  # a module registered by name (a precision family), imported when the registry loads
        for name in names:
            parts = name.split(".")
            if parts[0] == "ampbench":
                out |= {f for i in range(1, len(parts) + 1) if (f := _module_file(".".join(parts[:i])))}
    return out


def source_files(entry: Path, skip: frozenset[Path] = frozenset()) -> list[Path]:
    """Every ampbench source file ``entry`` reaches through its imports, followed from module to module (the
    files in ``skip`` neither counted nor followed); sorted."""
    seen: set[Path] = set()
    todo = [Path(entry).resolve()]
    while todo:
        for f in _ampbench_imports(todo.pop()):
            if f not in seen and f not in skip:
                seen.add(f)
                todo.append(f)
    return sorted(seen)


def source_digest(files: list[Path]) -> str:
    """A hash of these files' names (relative to the package) and contents: the code that produced a result."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).resolve().relative_to(PACKAGE.parent).as_posix().encode())
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]
