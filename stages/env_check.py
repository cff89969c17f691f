"""Stage env_check: probe the machine, validate params.yaml against it, write the run plans.

    python stages/env_check.py --params params.yaml --env reports/env.json --plans reports/plans

Writes reports/env.json (deterministic: no timestamps) and one plan file per
variant, holding exactly the settings that variant's train stage reads.
Stops in seconds, with the remedy, when the machine cannot run what is asked.
"""

import argparse
import json
from pathlib import Path

from ampbench import config, env
from ampbench.errors import run_cli
from ampbench.results import atomic_write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--env", required=True, help="where to write env.json")
    ap.add_argument("--plans", required=True, help="folder for one <variant>.json plan per variant")
    args = ap.parse_args()

    cfg = config.load(args.params)  # every check happens before anything is written
    info = env.probe()
    device = env.resolve_device(cfg.device, info, {v.precision for v in cfg.variants.values()})
    plans = {name: config.make_plan(cfg, name, device) for name in cfg.variants}
    for warning in env.warnings_for(info):
        print(f"warning: {warning}")
    if cfg.mlflow.enabled:
        uri = config.tracking_uri(cfg.mlflow, Path.cwd())
        problem = env.check_tracking_server(uri)
        if problem:
            print(f"warning: MLflow tracking server {uri} {problem}. Training will run and keep its results "
                  "on disk; log them later with `ampbench mlflow-sync`, or set mlflow.enabled: false")
    gpu = info["gpu"]
    print(f"env_check: device {device}" + (f" ({gpu['name']}, sm {gpu['capability']})" if gpu else "")
          + f", torch {info['torch']}, variants: {', '.join(plans)}")

    atomic_write(Path(args.env), json.dumps(info, indent=2, sort_keys=True) + "\n")
    plan_dir = Path(args.plans)
    plan_dir.mkdir(parents=True, exist_ok=True)
    for stale in plan_dir.glob("*.json"):
        if stale.stem not in plans:
            stale.unlink()
    for name, plan in plans.items():
        config.write_plan(plan, plan_dir / f"{name}.json")


if __name__ == "__main__":
    run_cli(main)
