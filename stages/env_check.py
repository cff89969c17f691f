"""Stage env_check: probe the machine, validate params.yaml against it, write the run plans.

    python stages/env_check.py --params params.yaml --env reports/env.json --plans reports/plans

Writes reports/env.json (deterministic: no timestamps), one plan file per
variant, holding exactly the settings that variant's train stage reads, and
data_source.json, what the data stage will make. Builds the model once on the
CPU and runs two images through it. Stops in seconds, with the remedy, when the
model, the data or the machine cannot run what is asked.
"""

import argparse
import json
from pathlib import Path

from ampbench import config, data, env, models, runplan
from ampbench.errors import run_cli
from ampbench.results import atomic_write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--env", required=True, help="where to write env.json")
    ap.add_argument("--plans", required=True, help="folder for one <variant>.json plan per variant")
    ap.add_argument("--data-source", required=True, help="where to write what the data stage will make")
    ap.add_argument("--model-source", required=True, help="where to write the model's source (the sweep's dep)")
    args = ap.parse_args()

    cfg = config.load(args.params)  # every check happens before anything is written
    desc = data.describe(cfg.data)  # the data source checks its own files (an archive, a folder) first
    info = env.probe()
    device = env.resolve_device(cfg.device, info, {v.precision for v in cfg.variants.values()})
    env.check_fits(data.resident_bytes(desc, cfg.train.augment), desc, device, info)
    model = models.check(cfg.model, num_classes=desc["num_classes"],
                         image_size=models.input_size(cfg.model, desc["image_size"]))
    source = models.source_record(cfg.model)  # the factory imported and hashed once, for the plans and the sweep
    plans = {name: runplan.make_plan(cfg, name, device, source["factory_source"]) for name in cfg.variants}
    env.check_distributed(cfg.distributed, device, info, {p.grad_comm for p in plans.values() if p.ddp})
    models.check_unused(model, cfg.model, cfg.distributed, any(p.ddp for p in plans.values()))
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
          + f", torch {info['torch']}, variants: {', '.join(plans)}"
          + (f", {cfg.distributed.nproc_per_node} processes per machine (torchrun, "
             f"{config.resolve_backend(cfg.distributed, device)})" if cfg.distributed.nproc_per_node > 1 else ""))
    print(f"env_check: model {model['model']} ({model['param_count']:,} parameters), data {cfg.data.source}: "
          f"{desc['train_count']:,} train / {desc['test_count']:,} test images, {desc['num_classes']} classes")

    atomic_write(Path(args.env), json.dumps(info, indent=2, sort_keys=True) + "\n")
    atomic_write(Path(args.data_source), json.dumps({"data": config.to_dict(cfg.data), "seed": cfg.seed, **desc},
                                                    indent=2, sort_keys=True) + "\n")
    atomic_write(Path(args.model_source), json.dumps(source, indent=2, sort_keys=True) + "\n")
    plan_dir = Path(args.plans)
    plan_dir.mkdir(parents=True, exist_ok=True)
    for stale in plan_dir.glob("*.json"):
        if stale.stem not in plans:
            stale.unlink()
    for name, plan in plans.items():
        runplan.write_plan(plan, plan_dir / f"{name}.json")


if __name__ == "__main__":
    run_cli(main)
