"""The report: ratios from known run files, missing values shown as missing, only listed variants."""

from __future__ import annotations

import json

import pytest

from ampbench import report, results

ENV = {"torch": "2.x", "cuda_runtime": None, "cudnn": None, "python": "3.11", "cpu_model": "Test CPU",
       "cpu_count": 2, "gpu": None}


def _write(runs, name, precision, accum, step_ms, mem, act, acc):
    metrics = {"variant": name, "precision": precision, "accum_steps": accum, "batch_size": 256, "epochs": 1,
               "imgs_per_s": 256 / step_ms * 1000, "epoch_time_s": 10.0,
               "step_time_ms": {"median": step_ms, "p10": step_ms * 0.9, "p90": step_ms * 1.1, "n": 5},
               "peak_mem_bytes": mem, "activation_bytes": act, "final_acc": acc, "best_acc": acc,
               "skipped_steps": 0, "tf32": {"matmul_fp32_precision": "ieee"}, "arch": "resnet18"}
    history = [{"epoch": 1, "train_loss": 1.0, "eval_loss": 1.0, "eval_acc": acc}]
    results.write_run(runs / name, metrics, history, [], [step_ms] * 5)


@pytest.fixture
def runs(tmp_path):
    runs = tmp_path / "runs"
    _write(runs, "fp32", "fp32", 1, 300.0, 1000, 400, 0.90)
    _write(runs, "amp", "fp16", 1, 100.0, 600, 200, 0.89)
    _write(runs, "removed", "fp16", 1, 1.0, 1, 1, 0.1)  # a variant no longer in params.yaml
    return runs


def test_summary_ratios(runs, tmp_path):
    s = report.build(runs, ENV, tmp_path / "report.md", tmp_path / "summary.json", tmp_path / "fig",
                     ["fp32", "amp"])
    assert list(s["variants"]) == ["fp32", "amp"] and s["baseline"] == "fp32"
    amp = s["variants"]["amp"]
    assert amp["speedup"] == pytest.approx(3.0) and amp["speedup_ci95"] == [pytest.approx(3.0)] * 2
    assert amp["mem_ratio"] == pytest.approx(0.6) and amp["activation_ratio"] == pytest.approx(0.5)
    assert amp["acc_diff"] == pytest.approx(-0.01)
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(s))
    md = (tmp_path / "report.md").read_text()
    assert "| amp | fp16 | 1 | 2,560 (2,327 to 2,844) | 3.00x (3.00 to 3.00) |" in md
    assert "bootstrap over step times" in md
    assert "-40%" in md and "-1.00 pts" in md and "removed" not in md
    assert "quoted, not measured here" in md and "3.2x" in md
    assert (tmp_path / "fig" / "throughput.png").stat().st_size > 1000
    assert "figures" not in md or "](fig/throughput.png)" in md


def test_missing_values_are_shown_as_missing(runs, tmp_path):
    m = json.loads((runs / "amp" / "metrics.json").read_text())
    m["peak_mem_bytes"] = None
    results.write_json(runs / "amp" / "metrics.json", m)
    s = report.build(runs, ENV, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "amp"])
    assert s["variants"]["amp"]["mem_ratio"] is None
    assert "| missing | n/a |" in (tmp_path / "r.md").read_text()


def test_a_variant_without_a_run_is_named_as_missing(runs, tmp_path):
    s = report.build(runs, ENV, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "amp", "bf16"])
    assert s["missing"] == ["bf16"] and "bf16" not in s["variants"]
    assert "No finished run for: bf16 (missing, not estimated)." in (tmp_path / "r.md").read_text()


def test_no_fp32_variant_means_no_ratios(runs, tmp_path):
    s = report.build(runs, ENV, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["amp"])
    assert s["baseline"] is None and "speedup" not in s["variants"]["amp"]
    assert "no fp32 variant" in (tmp_path / "r.md").read_text().lower()


def test_speedup_interval_from_repeats(runs, tmp_path):
    for name, ips in (("fp32", [1000.0, 1100.0, 900.0]), ("amp", [3000.0, 3100.0, 2900.0])):
        m = json.loads((runs / name / "metrics.json").read_text())
        m["imgs_per_s_runs"], m["repeats"] = ips, 3
        results.write_json(runs / name / "metrics.json", m)
    s = report.build(runs, ENV, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "amp"])
    amp = s["variants"]["amp"]
    assert amp["speedup"] == pytest.approx(3.0) and "repeats (3 vs 3)" in amp["speedup_ci_method"]
    lo, hi = amp["speedup_ci95"]
    assert 2.0 < lo < 3.0 < hi < 4.0
