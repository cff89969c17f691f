"""Shared fixtures: the real params.yaml, shrunk for a CPU; MLflow pointed at a temporary store."""

from __future__ import annotations

import copy
import hashlib
import io
import os
import pickle
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ampbench.sandbox import REPO_ROOT, merge

SHRINK = {
    "device": "cpu",
    "data": {"source": "synthetic", "train_size": 128, "test_size": 64},
    "model": {"arch": "small_cnn", "input_size": 16},  # fed at 16 px: a quarter of an emulated fp16 step's work
    "train": {"epochs": 1, "batch_size": 32, "warmup_steps": 1, "eval_batch_size": 64},
    "sweep": {"batch_sizes": [8, 16], "steps": 2},
    "profile": {"steps": 1},
    "paired": {"enabled": False},  # the pipeline test runs it (test_pipeline)
    "mlflow": {"log_model": False},  # 2 s a train stage; the pipeline and tracking tests turn it on
}


# One roofline cache for the session's processes (env_check keeps its counts in $XDG_CACHE_HOME/ampbench): the
# workers of one run share it, the user's own cache is never touched.
os.environ["XDG_CACHE_HOME"] = str(Path(tempfile.gettempdir()) / "ampbench-tests" /
                                   os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid())))

# Under pytest-xdist (make test runs two workers): one torch thread per worker and per process a test starts, so
# the two workers share the two cores instead of fighting over them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# The files with the longest tests (real `dvc repro` runs, servers), longest first: the two workers start on them,
# so the short files fill the gaps instead of one long file running alone at the end (pyproject's
# --no-loadscope-reorder keeps this order: xdist would otherwise put the files with the most tests first).
LONGEST_FIRST = ("test_zoo", "test_queue", "test_pipeline", "test_ddp_pipeline", "test_team", "test_resume",
                 "test_folder_stream", "test_tracking", "test_replay", "test_finetune", "test_fp8", "test_sweep",
                 "test_analyses", "test_distributed", "test_ddp_trainer", "test_models")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "requires_cuda" in item.keywords:
                item.add_marker(skip)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))  # stable otherwise


def load_stage(name: str):
    """A stage script (stages/<name>.py) as a module, as its process would run it: its ``import _here`` (the
    repository's src first on sys.path) resolved from the stages folder, which is not on this process's path."""
    import importlib.util
    import sys
    if "_here" not in sys.modules:
        spec = importlib.util.spec_from_file_location("_here", REPO_ROOT / "stages" / "_here.py")
        sys.modules["_here"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["_here"])
    spec = importlib.util.spec_from_file_location(f"{name}_stage", REPO_ROOT / "stages" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def real_params() -> dict:
    """The committed params.yaml as a dict."""
    return yaml.safe_load((REPO_ROOT / "params.yaml").read_text())


@pytest.fixture
def tiny_params(real_params) -> dict:
    """The committed params.yaml shrunk to seconds on a CPU (same keys, same variants)."""
    return merge(copy.deepcopy(real_params), SHRINK)


def _empty_store() -> Path:
    """An MLflow SQLite store with its schema made and nothing in it, once per MLflow version for the session's
    processes: a new store runs MLflow's migrations (about a second of CPU in the first process that logs to it)."""
    import mlflow
    template = Path(tempfile.gettempdir()) / "ampbench-tests" / f"mlflow-{mlflow.__version__}-empty.db"
    if not template.is_file():
        template.parent.mkdir(parents=True, exist_ok=True)
        fresh = template.with_suffix(f".{os.getpid()}.tmp")
        mlflow.MlflowClient(f"sqlite:///{fresh}").search_experiments()  # makes the schema
        os.replace(fresh, template)  # whole, whichever worker finishes first
    return template


@pytest.fixture(autouse=True)
def tmp_mlflow(tmp_path, monkeypatch):
    """Never log to the user's store: every test gets its own (an empty one, its schema already made)."""
    import shutil
    store = tmp_path / "mlflow-test.db"
    shutil.copyfile(_empty_store(), store)
    uri = f"sqlite:///{store}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def make_cifar_archive(folder: Path, per_batch: int = 6, test_count: int = 8, seed: int = 0,
                       kind: str = "cifar10") -> tuple[Path, str, dict]:
    """A tiny CIFAR archive in the real format (CIFAR-10's or CIFAR-100's); returns (path, md5, the arrays)."""
    rng = np.random.default_rng(seed)
    if kind == "cifar10":
        top, names, key, classes = "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], \
            b"labels", 10
        meta_name, meta = "batches.meta", {b"label_names": [b"c%d" % i for i in range(10)]}
    else:
        top, names, key, classes = "cifar-100-python", ["train", "test"], b"fine_labels", 100
        meta_name, meta = "meta", {b"fine_label_names": [b"f%d" % i for i in range(100)],
                                   b"coarse_label_names": [b"k%d" % i for i in range(20)]}
    arrays = {}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in names:
            n = test_count if name.startswith("test") else per_batch
            data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
            labels = [int(v) for v in rng.integers(0, classes, size=n)]
            arrays[name] = (data, labels)
            batch = {b"batch_label": name.encode(), key: labels, b"data": data, b"filenames": [b"x.png"] * n}
            if kind == "cifar100":
                batch[b"coarse_labels"] = [v // 5 for v in labels]
            blob = pickle.dumps(batch, protocol=2)
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
        blob = pickle.dumps(meta, protocol=2)
        info = tarfile.TarInfo(f"{top}/{meta_name}")
        info.size = len(blob)
        tar.addfile(info, io.BytesIO(blob))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ("cifar-10-python.tar.gz" if kind == "cifar10" else "cifar-100-python.tar.gz")
    path.write_bytes(buf.getvalue())
    return path, hashlib.md5(buf.getvalue()).hexdigest(), arrays


def overflow_at(monkeypatch, n: int) -> None:
    """The ``n``-th optimizer step's gradients get an inf, as an fp16 overflow would leave them."""
    from ampbench.train import step
    real = step.accumulate_gradients
    calls = {"n": 0}

    def poisoned(model, *args):
        loss = real(model, *args)
        calls["n"] += 1
        if calls["n"] == n:
            next(model.parameters()).grad[0].fill_(float("inf"))
        return loss

    monkeypatch.setattr(step, "accumulate_gradients", poisoned)


def verdict_of(md: str) -> str:
    """The report's verdict in full (its section's bullets, one per line), from report.md's text."""
    section = md.split("## The verdict in full", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line[2:] for line in section.splitlines() if line.startswith("- "))
