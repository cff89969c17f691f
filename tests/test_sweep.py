"""The batch-size sweep: the bisection's exact answer, out-of-memory handling, a CPU sweep end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from ampbench import sweep
from ampbench.sandbox import REPO_ROOT


@pytest.mark.parametrize(("start", "limit"), [(32, 700), (1, 1), (1024, 700), (64, 64), (8, 1023), (5, 0)])
def test_largest_batch_is_exact_against_a_fake_allocator(start, limit):
    freed = []

    def attempt(batch):  # an allocator that runs out above ``limit`` images
        if batch > limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory: tried {batch}")

    largest, tries = sweep.largest_batch(sweep.fits(attempt, lambda: freed.append(1)), start)
    assert largest == limit
    assert len(freed) == len(tries)  # memory freed after every attempt, fitting or not
    assert len(tries) <= 2 * (limit.bit_length() + start.bit_length()) + 2  # doubling then bisection, not a scan


def test_only_out_of_memory_means_it_does_not_fit():
    def attempt(batch):
        raise ValueError("a real bug")

    with pytest.raises(ValueError):
        sweep.fits(attempt, lambda: None)(8)


def test_largest_batch_respects_the_ceiling():
    assert sweep.largest_batch(lambda b: True, 16, ceiling=100)[0] == 64


def _stage(repo, *extra):
    return subprocess.run([sys.executable, str(REPO_ROOT / "stages" / "sweep.py"), "--params", "params.yaml",
                           "--data", "data/prepared", "--env", "reports/env.json", "--out", "reports/sweep", *extra],
                          cwd=repo, capture_output=True, text=True, timeout=300)


def test_cpu_sweep_writes_points_estimate_and_plots(tmp_path, tiny_params):
    tiny_params["sweep"] = {"batch_sizes": [4, 8, 16], "steps": 2, "precisions": ["fp32", "fp16"]}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params))
    for script, args in (("env_check.py", ["--env", "reports/env.json", "--plans", "reports/plans",
                                           "--data-source", "reports/data_source.json"]),
                         ("data.py", ["--out", "data/prepared", "--raw", "data/raw"])):
        proc = subprocess.run([sys.executable, str(REPO_ROOT / "stages" / script), "--params", "params.yaml", *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
    proc = _stage(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "reports" / "sweep"
    result = json.loads((out / "sweep.json").read_text())
    assert result["measured_points"] == 6 and result["reused_points"] == 0
    points = {(p["variant"], p["batch_size"]): p for p in result["points"]}
    assert set(points) == {(p, b) for p in ("fp32", "fp16") for b in (4, 8, 16)}
    for p in points.values():
        assert p["imgs_per_s"] > 0 and p["imgs_per_s_p10"] <= p["imgs_per_s"] <= p["imgs_per_s_p90"]
        assert p["activation_bytes"] > 0
    for prec in ("fp32", "fp16"):  # activations grow with the batch: twice the batch, about twice the bytes
        ratio = points[(prec, 16)]["activation_bytes"] / points[(prec, 8)]["activation_bytes"]
        assert 1.9 < ratio < 2.1
    assert points[("fp16", 16)]["activation_bytes"] < 0.75 * points[("fp32", 16)]["activation_bytes"]
    largest = result["largest"]
    assert largest["fp32"]["method"] == largest["fp16"]["method"] == "estimate"  # a CPU does not run out
    assert largest["fp16"]["largest_batch"] > largest["fp32"]["largest_batch"] > 0
    assert (out / "sweep.csv").read_text().splitlines()[0].startswith("variant,batch_size,imgs_per_s")
    before = {p.name: p.read_bytes() for p in (out / "points").iterdir()}

    tiny_params["sweep"]["batch_sizes"] = [4, 8, 12]  # 16 out, 12 in: only 12 is measured again
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params))
    proc = _stage(tmp_path)
    assert proc.returncode == 0 and "2 point(s) measured, 4 reused" in proc.stdout, proc.stdout
    after = {p.name: p.read_bytes() for p in (out / "points").iterdir()}
    assert set(after) == {f"{p}-{b}.json" for p in ("fp32", "fp16") for b in (4, 8, 12)}
    assert all(after[n] == before[n] for n in after if n in before)  # reused points are untouched


def test_disabled_sweep_writes_an_empty_result(tmp_path, tiny_params):
    tiny_params["sweep"] = {"enabled": False}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params))
    proc = _stage(tmp_path)
    assert proc.returncode == 0 and "disabled" in proc.stdout
    assert json.loads((tmp_path / "reports" / "sweep" / "sweep.json").read_text()) == {"enabled": False}
