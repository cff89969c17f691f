"""The zoo through the whole pipeline: a shrunk `dvc repro` per model, each in its own sandbox repository.

    python benchmarks/zoo_pipeline.py            # the models that stopped `dvc repro` before (and AlexNet)
    python benchmarks/zoo_pipeline.py --models tv:resnet50,tv:vit_b_16 --out /tmp/zoo_pipeline

Each model runs the real pipeline (env_check, data, train@fp32, train@bf16, train@amp, sweep, report, each
variant's MLflow LoggedModel) on 64 synthetic CIFAR-shaped images for one epoch: the committed params.yaml shrunk,
`model.arch` set, nothing else. A model either trains through to a report, or env_check stops it in one line that
names the fix; a traceback anywhere is a failure. Writes <out>.md with one row per model: what happened, the
stage's one line (or the analyses that warned), and the time it took.
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from ampbench import sandbox

TABLE = ("tv:regnet_y_400mf", "tv:efficientnet_b0", "tv:mobilenet_v3_small", "tv:convnext_tiny", "tv:squeezenet1_0",
         "tv:googlenet", "tv:vit_b_16", "tv:inception_v3", "tv:maxvit_t", "tv:alexnet")
SHRUNK = {"device": "cpu", "data": {"source": "synthetic", "train_size": 64, "test_size": 32},
          "train": {"epochs": 1, "batch_size": 32, "warmup_steps": 1, "eval_batch_size": 32},
          "variants": {"fp32": {"precision": "fp32", "accum_steps": 1}, "bf16": {"precision": "bf16", "accum_steps": 1},
                       "amp": {"precision": "fp16", "accum_steps": 1}},
          "profile": {"steps": 1}, "sweep": {"batch_sizes": [8, 16], "steps": 1}}


def params_for(arch: str, overrides: dict | None = None) -> dict:
    """The committed params.yaml shrunk, with ``model.arch`` and the overrides (``variants`` replaced whole)."""
    base = yaml.safe_load((sandbox.REPO_ROOT / "params.yaml").read_text())
    params = sandbox.merge(sandbox.merge(copy.deepcopy(base), {**SHRUNK, "model": {"arch": arch}}), overrides or {})
    if overrides and "variants" in overrides:
        params["variants"] = overrides["variants"]
    return params


def parse_set(items: list[str]) -> dict:
    """``["sweep.enabled=false", ...]`` -> ``{"sweep": {"enabled": False}}`` (values read as YAML)."""
    out: dict = {}
    for item in items:
        key, _, value = item.partition("=")
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return out


def repro(arch: str, where: Path, overrides: dict | None = None, timeout: float = 1800) -> dict:
    """One model's shrunk `dvc repro`: ``{"model", "outcome", "line", "s"}``; outcome trained | stopped | FAILED."""
    repo = sandbox.create(where, params_for(arch, overrides))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, capture_output=True, text=True,
                              timeout=timeout, env=sandbox.env_with_venv())
    except subprocess.TimeoutExpired:
        return {"model": arch, "outcome": "FAILED", "line": f"no end within {timeout:.0f} s", "s": timeout}
    seconds = time.perf_counter() - t0
    text = proc.stdout + proc.stderr
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    if "Traceback" in text:
        outcome, line = "FAILED", "a traceback: " + text[text.index("Traceback"):][-300:].replace("\n", " ")
    elif proc.returncode == 0 and (repo / "reports" / "report.md").is_file():
        warned = [ln for ln in text.splitlines() if ln.startswith("warning: ") and "could not be made" in ln]
        outcome, line = "trained", "; ".join(warned) or "every analysis made"
    elif errors and "Running stage 'data'" not in text:
        outcome, line = "stopped", errors[0]
    else:
        outcome, line = "FAILED", (errors or text.splitlines()[-1:] or [""])[0]
    return {"model": arch, "outcome": outcome, "line": line, "s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(TABLE), help="comma-separated model.arch values")
    ap.add_argument("--out", default=str(sandbox.REPO_ROOT / "benchmarks" / "results" / "zoo_pipeline"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a params.yaml value on top of the shrunk ones, e.g. sweep.enabled=false (repeatable)")
    args = ap.parse_args()
    rows, overrides = [], parse_set(args.set)
    with tempfile.TemporaryDirectory() as tmp:
        for i, arch in enumerate(a for a in args.models.split(",") if a):
            row = repro(arch, Path(tmp) / f"repo{i}", overrides)
            rows.append(row)
            print(f"[zoo pipeline] {arch}: {row['outcome']} in {row['s']:.0f} s: {row['line']}", flush=True)
    lines = ["# The zoo through `dvc repro`", "",
             f"`python benchmarks/zoo_pipeline.py {' '.join(sys.argv[1:])}`: a shrunk pipeline per model (64 "
             "synthetic 32x32 images, one epoch, fp32, bf16 and fp16, the sweep at batches 8 and 16) on the CPU.", "",
             "| model | outcome | the one line | s |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['outcome']} | {r['line']} | {r['s']:.0f} |" for r in rows]
    out = Path(args.out).with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"written: {out}")
    sys.exit(1 if any(r["outcome"] == "FAILED" for r in rows) else 0)


if __name__ == "__main__":
    main()
