"""A self-contained copy of the pipeline in its own folder, to run `dvc repro` without touching yours.

The CPU demo and the end-to-end test both use it: the same dvc.yaml, stage
scripts and library, a params.yaml of their own, their own git and DVC
repositories, and their own MLflow store, so the user's params.yaml and
results are never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ["dvc.yaml", "stages", "src/ampbench"]

# The CPU demo: the user's params with the data, model and run shrunk to fit two CPU minutes.
DEMO_OVERRIDES = {
    "device": "cpu",
    "data": {"source": "synthetic", "train_size": 192, "test_size": 128},
    "model": {"arch": "small_cnn"},
    "train": {"epochs": 3, "batch_size": 16, "warmup_steps": 4, "eval_batch_size": 128},
    "sweep": {"batch_sizes": [8, 16, 32], "steps": 2},
    "mlflow": {"log_model": False},  # a model of 3 CPU epochs is not one to keep
}


def merge(base: dict, overrides: dict) -> dict:
    """``base`` with ``overrides`` applied, section by section."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def env_with_venv() -> dict:
    """The environment with this interpreter's folder first on PATH, so stage commands find it as `python`."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(cmd: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env_with_venv(), check=True, **kw)


def create(dest: Path, params: dict, source: Path = REPO_ROOT) -> Path:
    """Copy the pipeline into ``dest`` (a git + DVC repository) with ``params`` as its params.yaml."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for rel in PIPELINE:
        src, dst = source / rel, dest / rel
        if src.is_dir():
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    if not (dest / ".git").exists():
        _run(["git", "init", "-q"], dest)
        (dest / ".gitignore").write_text("/mlflow.db\n/mlartifacts/\n/data/raw/\n/checkpoints/\n/.dvc/plots.html\n")
    if not (dest / ".dvc").exists():
        _run([sys.executable, "-m", "dvc", "init", "-q"], dest)
        # what `dvc config core.analytics false` and `dvc config plots.html_template plots.html` write into the new
        # repository's empty config, without more DVC processes
        (dest / ".dvc" / "config").write_text("[core]\n    analytics = false\n"
                                              "[plots]\n    html_template = plots.html\n")
    shutil.copytree(source / ".dvc" / "plots", dest / ".dvc" / "plots", dirs_exist_ok=True)  # plot templates
    _plots_page(source / ".dvc" / "plots.html", dest / ".dvc" / "plots.html")
    _untrack_cached_outs(dest)
    commit(dest, "ampbench pipeline")  # so that `dvc exp run` works there
    return dest


def cached_outs(dvc_yaml: Path) -> list[str]:
    """The outputs ``dvc_yaml`` has DVC cache (and git ignore): every out not marked ``cache: false``."""
    found = []
    for stage in (yaml.safe_load(Path(dvc_yaml).read_text()) or {}).get("stages", {}).values():
        for out in stage.get("outs") or ():
            path, opts = next(iter(out.items())) if isinstance(out, dict) else (out, None)
            if (opts or {}).get("cache", True):
                found.append(path)
    return found


def _untrack_cached_outs(dest: Path) -> None:
    """A sandbox made by an older ampbench may have committed a file this pipeline now caches with DVC (the report's
    page): DVC refuses to write an output git tracks, so it leaves git's index (the file stays on disk) and is
    ignored as DVC ignores its outputs (``/name`` in its folder's .gitignore)."""
    outs = cached_outs(dest / "dvc.yaml")
    if not outs:
        return
    _run(["git", "rm", "-r", "-q", "--cached", "--ignore-unmatch", "--", *outs], dest)
    for out in outs:
        ignore = (dest / out).parent / ".gitignore"
        lines = ignore.read_text().splitlines() if ignore.is_file() else []
        if f"/{Path(out).name}" not in lines:
            ignore.parent.mkdir(parents=True, exist_ok=True)
            ignore.write_text("".join(f"{line}\n" for line in [*lines, f"/{Path(out).name}"]))


def _plots_page(src: Path, dst: Path) -> None:
    """`dvc plots show`'s offline page (report/dvc_template.py): the one `make install` made, else made here."""
    if src.is_file():
        shutil.copy2(src, dst)
    else:
        from ampbench.report import dvc_template
        dvc_template.write(dst)


def commit(dest: Path, message: str) -> None:
    """Commit whatever changed in the sandbox (code, params, dvc.lock, metrics)."""
    _run(["git", "add", "-A"], dest)
    if subprocess.run(["git", "diff", "--cached", "--quiet"], cwd=dest).returncode:
        _run(["git", "-c", "user.name=ampbench", "-c", "user.email=ampbench@localhost", "commit", "-q", "-m",
              message], dest)


def repro(dest: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `dvc repro` in the sandbox, output streaming to the terminal, a SIGTERM passed on to it and its stages
    waited for (``errors.supervise``)."""
    from ampbench.errors import supervise
    cmd = [sys.executable, "-m", "dvc", "repro", *args]
    done = subprocess.CompletedProcess(cmd, supervise(cmd, cwd=dest, env=env_with_venv()))
    if check:
        done.check_returncode()
    return done


def data_parallel(params: dict, nproc: int) -> dict:
    """``params`` trained by ``nproc`` processes, with what the report needs to judge it: each variant once more
    in one process (``<name>_1proc``, ddp: false), and the first fp32 variant with fp16 gradient communication."""
    variants = {}
    for name, spec in params["variants"].items():
        variants[name] = spec
        variants[f"{name}_1proc"] = {**spec, "ddp": False}
    fp32 = next((n for n, v in params["variants"].items() if v.get("precision") == "fp32"),
                next(iter(params["variants"])))
    variants[f"{fp32}_fp16comm"] = {**params["variants"][fp32], "grad_comm": "fp16", "strategy": "ddp"}  # DDP's hook
    return {**merge(params, {"distributed": {"nproc_per_node": nproc}}), "variants": variants}


def demo_params(source: Path = REPO_ROOT) -> dict:
    user = yaml.safe_load((source / "params.yaml").read_text()) or {}
    return merge(user, DEMO_OVERRIDES)
