"""Stage report: runs on disk -> reports/report.md, report.html, metrics.json (DVC metrics), summary.json, figures.

    python stages/report.py --params params.yaml --runs reports/runs --env reports/env.json \
        --report reports/report.md --html reports/report.html --metrics reports/metrics.json \
        --summary reports/summary.json --figures reports/figures
"""

import argparse
import json
import time
from pathlib import Path

import _here  # noqa: F401  ampbench from this repository's src (stages/_here.py)

from ampbench import config, report, results
from ampbench.errors import run_cli


def _optional_json(path: str) -> dict | None:
    """An optional input file's content: None when not given or not there."""
    return json.loads(Path(path).read_text()) if path and Path(path).is_file() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--runs", required=True)
    ap.add_argument("--env", required=True)
    ap.add_argument("--plans", required=True, help="the run plans, to tag the report with its pipeline")
    ap.add_argument("--sweep", default="", help="sweep.json of the sweep stage (optional)")
    ap.add_argument("--report", required=True)
    ap.add_argument("--html", required=True, help="the report as one self-contained page")
    ap.add_argument("--metrics", required=True, help="the headline figures per variant: DVC's declared metric")
    ap.add_argument("--summary", required=True, help="every figure the report shows")
    ap.add_argument("--figures", required=True)
    ap.add_argument("--curves", required=True, help="per-epoch curves of all variants, for dvc plots")
    ap.add_argument("--roofline", default="", help="env_check's roofline.json (optional)")
    ap.add_argument("--paired", default="", help="paired.json of the paired stage (optional)")
    args = ap.parse_args()

    cfg = config.load(args.params)
    info = json.loads(Path(args.env).read_text())
    md, summary_path, fig_dir = Path(args.report), Path(args.summary), Path(args.figures)
    started = int(time.time() * 1000)
    changed = {k: v for k, v in config.flatten(config.to_dict(cfg)).items()
               if config.flatten(config.to_dict(config.Config())).get(k, object()) != v}
    summary = report.build(Path(args.runs), info, md, summary_path, fig_dir, list(cfg.variants), changed,
                           curves_csv=Path(args.curves), target_acc=cfg.train.target_acc,
                           sweep=_optional_json(args.sweep), roofline=_optional_json(args.roofline),
                           paired=_optional_json(args.paired), metrics_json=Path(args.metrics),
                           report_html=Path(args.html))
    built = int(time.time() * 1000)
    print(f"report: {md} ({len(summary['variants'])} variants, baseline {summary['baseline']})")

    if cfg.mlflow.enabled:
        from ampbench import tracking
        pipeline = tracking.pipeline_id(Path(args.plans), Path(args.env))
        tracking.safely("report", tracking.log_report, cfg.mlflow, Path.cwd(), md, summary_path, fig_dir, info,
                        pipeline, (started, built), Path(args.html), Path(args.metrics),
                        results_of=(summary_path, md))
        tracking.safely("the ratios on the training runs", tracking.log_comparison, cfg.mlflow, Path.cwd(),
                        summary_path, Path(args.runs), results_of=(summary_path,))
        waiting = results.pending_line(config.project_root(Path.cwd()))
        if waiting:
            print(f"warning: {waiting}", flush=True)


if __name__ == "__main__":
    run_cli(main)
