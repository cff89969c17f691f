"""The report: runs on disk -> report.md, summary.json (DVC metrics) and figures.

It reads only ``reports/runs/*/`` and ``reports/env.json``, never MLflow, so it
works offline. Every number comes from those files; a measurement that is
missing is shown as missing.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ampbench import explain, markdown, measure, scaling, sweepreport
from ampbench.errors import DataError
from ampbench.figures import all_figures
from ampbench.results import atomic_write, csv_text, read_runs, write_json


def pick_baseline(runs: dict[str, dict]) -> str | None:
    """The fp32, no-accumulation run the ratios are taken against (``fp32`` if so named)."""
    candidates = [n for n, r in runs.items()
                  if r["metrics"]["precision"] == "fp32" and r["metrics"]["accum_steps"] == 1]
    if "fp32" in candidates:
        return "fp32"
    return candidates[0] if candidates else None


def _ratio(a, b) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def _speedup_with_ci(base: dict, run: dict) -> dict:
    """Speedup over the baseline and its 95% interval: from repeats when both have 2+, else a bootstrap."""
    bm, m = base["metrics"], run["metrics"]
    b_runs, v_runs = bm.get("imgs_per_s_runs") or [], m.get("imgs_per_s_runs") or []
    if len(b_runs) >= 2 and len(v_runs) >= 2:
        ratio, lo, hi = measure.ratio_ci_from_repeats(v_runs, b_runs)
        return {"speedup": ratio, "speedup_ci95": [lo, hi],
                "speedup_ci_method": f"t-interval over repeats ({len(v_runs)} vs {len(b_runs)})"}
    b_ms = (bm.get("step_time_ms") or {}).get("median")
    ratio = _ratio(b_ms, (m.get("step_time_ms") or {}).get("median"))  # same step times as the interval
    lo, hi = measure.bootstrap_ratio_ci(base["step_times_ms"], run["step_times_ms"])
    return {"speedup": ratio, "speedup_ci95": [None if math.isnan(lo) else lo, None if math.isnan(hi) else hi],
            "speedup_ci_method": "bootstrap over step times (median ratio)"}


COPIED = ("precision", "accum_steps", "imgs_per_s", "imgs_per_s_std", "epoch_time_s", "peak_mem_bytes",
          "peak_reserved_bytes", "mem_meter", "activation_bytes", "param_bytes", "grad_bytes",
          "optimizer_state_bytes", "dataset_bytes", "final_acc", "final_acc_std", "best_acc", "skipped_steps",
          "nonfinite_loss_steps", "final_loss_scale", "data_time_fraction", "accum_grad_max_rel_diff",
          "achieved_tflops", "fraction_of_peak", "peak_tflops_datasheet", "peak_precision", "world_size", "backend",
          "grad_comm", "imgs_per_s_per_process")


def summarize(runs: dict[str, dict], target_acc: float = 0.0) -> dict:
    """Per-variant figures and ratios against the fp32 baseline; the profile comparison; time to accuracy."""
    base = pick_baseline(runs)
    bm = runs[base]["metrics"] if base else {}
    out = {"baseline": base, "variants": {}, "target_acc": target_acc or None, "profile_comparison": {}}
    for name, run in runs.items():
        m = run["metrics"]
        row = {key: m.get(key) for key in COPIED}
        row.update(repeats=m.get("repeats", 1), status=m.get("status", "complete"),
                   step_time_ms_median=(m.get("step_time_ms") or {}).get("median"))
        row["profile"] = m.get("profile")
        if target_acc:
            reached = explain.time_to_accuracy(run["history"], target_acc)
            row["time_to_target_s"], row["time_to_target_epoch"] = reached or (None, None)
        spread = measure.throughput_spread(m.get("batch_size"), m.get("step_time_ms"))
        row["imgs_per_s_p10_p90"] = list(spread[1:]) if spread else None
        if base:
            row.update(_speedup_with_ci(runs[base], run))
            row["mem_ratio"] = _ratio(row["peak_mem_bytes"], bm.get("peak_mem_bytes"))
            row["activation_ratio"] = _ratio(row["activation_bytes"], bm.get("activation_bytes"))
            acc, b_acc = row["final_acc"], bm.get("final_acc")
            row["acc_diff"] = None if acc is None or b_acc is None else acc - b_acc
            if name != base:
                cmp = explain.compare(bm, m, _ratio(m.get("peak_tflops_datasheet"), bm.get("peak_tflops_datasheet")))
                if cmp:
                    out["profile_comparison"][name] = cmp
        out["variants"][name] = row
    return out


def build(runs_dir: Path, env: dict, report_md: Path, summary_json: Path, fig_dir: Path,
          variants: list[str], changed_params: dict | None = None, curves_csv: Path | None = None,
          target_acc: float = 0.0, sweep: dict | None = None) -> dict:
    """Write report.md, summary.json and figures from the runs on disk; return the summary.

    Only ``variants`` (those in params.yaml, in its order) are reported: a folder
    left behind by a variant since removed is not this run's result.
    """
    found = read_runs(runs_dir)
    runs = {name: found[name] for name in variants if name in found}
    if not runs:
        raise DataError(f"no finished runs under {runs_dir}; run the train stages first (dvc repro)")
    summary = summarize(runs, target_acc)
    summary["missing"] = [name for name in variants if name not in runs]  # asked for, but no finished run
    summary["sweep"] = sweepreport.summarize(sweep)
    summary["scaling"] = scaling.summarize(runs)
    figures = all_figures(runs, fig_dir) + sweepreport.figures(summary["sweep"], fig_dir)
    rel = [Path(os.path.relpath(f, report_md.parent)).as_posix() for f in figures]
    atomic_write(report_md, markdown.render(summary, env, runs, rel, changed_params or {}))
    write_json(summary_json, summary)
    if curves_csv is not None:  # long format: one row per variant and epoch, for dvc plots
        rows = [{"variant": n, **{k: r[k] for k in ("epoch", "eval_acc", "train_loss", "eval_loss")}}
                for n, run in runs.items() for r in run["history"]]
        atomic_write(curves_csv, csv_text(rows, ["variant", "epoch", "eval_acc", "train_loss", "eval_loss"]))
    return summary
