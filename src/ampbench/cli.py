"""The ampbench command.

    ampbench demo            # the same DVC pipeline on the CPU, synthetic data, small model; results in demo/
    ampbench demo --nproc-per-node 2   # the same, data-parallel over 2 processes (torchrun, gloo)
    ampbench mlflow-sync     # log the on-disk runs that are not in MLflow yet (after a tracking outage)
    ampbench mlflow-ui       # the MLflow UI on this repository's store, opened on the runs table
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from pathlib import Path

from ampbench import config, sandbox
from ampbench.errors import ConfigError, run_cli


def demo(dest: Path, arch: str = "", nproc: int = 1) -> None:
    params = sandbox.demo_params()
    if arch:  # e.g. vit_tiny: the same demo, another model
        params = sandbox.merge(params, {"model": {"arch": arch}})
    if nproc > 1:  # DDP, beside one-process runs of the same variants
        params = sandbox.data_parallel(params, nproc)
    config.from_dict(params)  # a bad value in the user's params.yaml is reported before anything runs
    t0 = time.perf_counter()
    sandbox.create(dest, params)
    try:
        sandbox.repro(dest)
    except subprocess.CalledProcessError as err:
        sys.exit(err.returncode)
    sandbox.commit(dest, "ampbench demo results")  # the baseline for `dvc exp show` there
    print(f"\ndemo finished in {time.perf_counter() - t0:.0f}s: {dest / 'reports' / 'report.md'}\n"
          f"MLflow UI: ampbench mlflow-ui --store {dest / 'mlflow.db'}")


def mlflow_sync(args) -> None:
    from ampbench import tracking
    cfg = config.load(args.params)
    r = Path(args.reports)
    failed = tracking.sync(cfg.mlflow, Path.cwd(), r / "runs", r / "plans", r / "env.json", r / "report.md",
                           r / "summary.json", r / "figures")
    if failed:
        sys.exit(1)


def mlflow_ui(args) -> None:
    """Start `mlflow ui` on the store and say which page shows the runs (MLflow 3 opens on its GenAI view)."""
    from ampbench import tracking
    cfg = config.load(args.params).mlflow if Path(args.params).is_file() else config.MlflowConfig()
    uri = f"sqlite:///{Path(args.store).resolve()}" if args.store else config.tracking_uri(cfg, Path.cwd())
    if args.store and not Path(args.store).is_file():
        raise ConfigError(f"--store {args.store}: no such file; run `make demo` (demo/mlflow.db) or "
                                 "`make repro` (mlflow.db) first")
    exp_id = tracking.prepare_ui(cfg, uri, Path.cwd())
    if uri.startswith(("http://", "https://")):  # a tracking server already serves its own UI
        print(f"open {tracking.ui_url(uri, exp_id)}")
        return
    base = f"http://{args.host}:{args.port}"
    pipeline = tracking.latest_pipeline(uri, exp_id) if exp_id else None
    print(f"MLflow UI for {uri}\nopen {tracking.ui_url(base, exp_id)}\n"
          f"  the runs table: search tags.`ampbench.pipeline` = '{pipeline or '<id>'}' for one pipeline's runs, tick "
          "them and press Compare, or click the chart icon for every metric side by side", flush=True)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a UI is stopped
        subprocess.run([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", args.host,
                        "--port", str(args.port)], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(prog="ampbench", description="FP32 vs FP16-AMP, measured on your hardware")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the pipeline on the CPU with synthetic data, in its own folder")
    d.add_argument("--dir", default="demo", help="folder for the demo's repository (default: demo)")
    d.add_argument("--arch", default="", help="model.arch for the demo instead of small_cnn, e.g. vit_tiny "
                                              "(fp16 is emulated on a CPU: a transformer takes minutes)")
    d.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                   help="train under torchrun with N processes (gloo), each variant also once in one process "
                        "for the scaling efficiency, and fp32 with fp16 gradient communication")
    s = sub.add_parser("mlflow-sync", help="log on-disk runs missing from MLflow (no duplicates)")
    s.add_argument("--params", default="params.yaml")
    s.add_argument("--reports", default="reports", help="the pipeline's reports folder")
    u = sub.add_parser("mlflow-ui", help="start the MLflow UI on this repository's runs and print its URL")
    u.add_argument("--params", default="params.yaml")
    u.add_argument("--store", default="", help="an ampbench SQLite store, e.g. demo/mlflow.db (default: params)")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=5000)
    args = ap.parse_args()
    if args.command == "mlflow-ui":
        run_cli(lambda: mlflow_ui(args))
    elif args.command == "demo":
        run_cli(lambda: demo(Path(args.dir), args.arch, args.nproc_per_node))
    elif args.command == "mlflow-sync":
        run_cli(lambda: mlflow_sync(args))


if __name__ == "__main__":
    main()
