"""The report stage's library: run folders on disk -> report.md, report.html, metrics.json (DVC's declared
metric: the headline figures), summary.json (every figure), figures, curves.

    build(runs_dir, env, report_md, summary_json, fig_dir, variants, ...)

It reads only ``reports/runs/*/``, ``reports/env.json``, the sweep's ``sweep.json`` and env_check's
``roofline.json``, never MLflow, so it works offline, and it imports no training code, so editing the training
loop does not rerun it. The parts: ``summary`` (the numbers, no prose), ``sections`` (report.md, one function per
section, in one ordered list), ``glance`` (the first screen), ``verdict`` (the verdict in full), ``page``
(report.html); one module per large section: ``roofline`` (and the article's), ``memory``, ``safety``
(numerics), ``scale`` (the sweep's and data-parallel sections); ``figures`` and ``fmt`` (how a number is
written). A measurement that is missing is shown as missing.
"""

from __future__ import annotations

import os
from pathlib import Path

from ampbench.config import redact_text
from ampbench.errors import DataError
from ampbench.report import figures, page, sections
from ampbench.report.summary import headline_metrics, summarize
from ampbench.results import atomic_write, csv_text, read_runs, write_json

CURVE_COLUMNS = ["variant", "epoch", "eval_acc", "train_loss", "eval_loss"]


def build(runs_dir: Path, env: dict, report_md: Path, summary_json: Path, fig_dir: Path,
          variants: list[str], changed_params: dict | None = None, curves_csv: Path | None = None,
          target_acc: float = 0.0, sweep: dict | None = None, roofline: dict | None = None,
          paired: dict | None = None, metrics_json: Path | None = None, report_html: Path | None = None) -> dict:
    """Write report.md, summary.json and figures (and metrics.json, report.html where given) from the runs on disk;
    return the summary.

    Only ``variants`` (those in params.yaml, in its order) are reported: a folder
    left behind by a variant since removed is not this run's result.
    """
    found = read_runs(runs_dir)
    runs = {name: found[name] for name in variants if name in found}
    if not runs:
        raise DataError(f"no finished runs under {runs_dir}; run the train stages first (dvc repro)")
    summary = summarize(runs, target_acc, sweep, roofline, paired)
    summary["missing"] = [name for name in variants if name not in runs]  # asked for, but no finished run
    # passwords redacted here too (params.yaml refuses them; a value set another way must not reach git)
    summary["params_changed"] = {k: redact_text(v) if isinstance(v, str) else v
                                 for k, v in sorted((changed_params or {}).items())}
    Path(fig_dir).mkdir(parents=True, exist_ok=True)  # a DVC output, even when no figure could be drawn
    drawn, summary["figures_not_drawn"] = figures.draw(summary, runs, fig_dir)
    summary["figures"] = [Path(os.path.relpath(f, report_md.parent)).as_posix() for f in drawn]
    text = sections.render(summary, env, runs)
    atomic_write(report_md, text)
    if report_html is not None:
        atomic_write(report_html, page.render(text, Path(report_md).parent))
    write_json(summary_json, summary)
    if metrics_json is not None:
        write_json(metrics_json, headline_metrics(summary))
    if curves_csv is not None:  # long format: one row per variant and epoch, for dvc plots
        rows = [{"variant": n, **{k: r[k] for k in CURVE_COLUMNS[1:]}}
                for n, run in runs.items() for r in run["history"]]
        atomic_write(curves_csv, csv_text(rows, CURVE_COLUMNS))
    return summary
