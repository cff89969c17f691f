"""The ampbench command.

    ampbench demo            # the same DVC pipeline on the CPU, synthetic data, small model; results in demo/
    ampbench mlflow-sync     # log the on-disk runs that are not in MLflow yet (after a tracking outage)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from ampbench import config, sandbox
from ampbench.errors import run_cli


def demo(dest: Path) -> None:
    params = sandbox.demo_params()
    config.from_dict(params)  # a bad value in the user's params.yaml is reported before anything runs
    t0 = time.perf_counter()
    sandbox.create(dest, params)
    try:
        sandbox.repro(dest)
    except subprocess.CalledProcessError as err:
        sys.exit(err.returncode)
    sandbox.commit(dest, "ampbench demo results")  # the baseline for `dvc exp show` there
    print(f"\ndemo finished in {time.perf_counter() - t0:.0f}s: {dest / 'reports' / 'report.md'}\n"
          f"MLflow UI: mlflow ui --backend-store-uri sqlite:///{(dest / 'mlflow.db').resolve()}")


def mlflow_sync(args) -> None:
    from ampbench import tracking
    cfg = config.load(args.params)
    r = Path(args.reports)
    failed = tracking.sync(cfg.mlflow, Path.cwd(), r / "runs", r / "plans", r / "env.json", r / "report.md",
                           r / "summary.json", r / "figures")
    if failed:
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser(prog="ampbench", description="FP32 vs FP16-AMP, measured on your hardware")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the pipeline on the CPU with synthetic data, in its own folder")
    d.add_argument("--dir", default="demo", help="folder for the demo's repository (default: demo)")
    s = sub.add_parser("mlflow-sync", help="log on-disk runs missing from MLflow (no duplicates)")
    s.add_argument("--params", default="params.yaml")
    s.add_argument("--reports", default="reports", help="the pipeline's reports folder")
    args = ap.parse_args()
    if args.command == "demo":
        run_cli(lambda: demo(Path(args.dir)))
    elif args.command == "mlflow-sync":
        run_cli(lambda: mlflow_sync(args))


if __name__ == "__main__":
    main()
