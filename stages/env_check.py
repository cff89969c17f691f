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
import os
from pathlib import Path

from ampbench import config, data, env, models, precision, runplan
from ampbench.config import optim
from ampbench.errors import analysis, run_cli
from ampbench.measure import roofline
from ampbench.results import atomic_write


def micro_batches(cfg: config.Config, rung: str) -> dict[str, int]:
    """Where params.yaml sets each micro-batch precision ``rung`` trains on (its variants', the sweep's points) ->
    its images."""
    out = {}
    for name, v in cfg.variants.items():
        if v.precision == rung:
            world = config.variant_world(cfg, name)
            where = (f"train.batch_size = {cfg.train.batch_size} over variants.{name}.accum_steps = {v.accum_steps}"
                     + (f" and {world} processes" if world > 1 else ""))
            out[where] = config.micro_batch(cfg.train.batch_size, world, v.accum_steps, name)
    if cfg.sweep.enabled and rung in config.sweep_precisions(cfg):
        out.update({f"sweep.batch_sizes ({b})": b for b in cfg.sweep.batch_sizes})
    return out


def census(cfg: config.Config, device: str, image_size: int, num_classes: int) -> tuple[dict, list[str]]:
    """What each converting rung the variants train in converts in this model (counted by forward hooks), by
    rung, and what to warn of; a recipe that cannot run on this device stops here."""
    used = precision.converting(v.precision for v in cfg.variants.values())
    if not used:
        return {}, []
    for name, v in cfg.variants.items():
        if v.precision in used:
            precision.rung(v.precision).check(name, v.fp8_recipe or None, device)
    model = models.build_meta(cfg.model, num_classes=num_classes, image_size=image_size)
    found, warnings = {}, []
    for p in used:
        rung = precision.rung(p)
        counted, why = analysis("fp8_census", models.name(cfg.model), rung.census, model, runplan.recipe(cfg, p),
                                image_size)
        if counted is None:  # training converts the model itself; the report says what could not be counted
            found[p] = {"error": why}
            continue
        rung.check_batches(counted, micro_batches(cfg, p))
        warnings += rung.warnings(counted, cfg.train.compile, device, models.name(cfg.model))
        found[p] = counted
    return found, warnings


def _last(path: Path) -> dict | None:
    """The last data_source.json this stage wrote, if any (a folder's header check is reused when unchanged)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--env", required=True, help="where to write env.json")
    ap.add_argument("--plans", required=True, help="folder for one <variant>.json plan per variant")
    ap.add_argument("--data-source", required=True, help="where to write what the data stage will make")
    ap.add_argument("--model-source", required=True, help="where to write the model's source (the sweep's dep)")
    ap.add_argument("--roofline", required=True, help="where to write the model's roofline (the report's dep)")
    args = ap.parse_args()

    cfg = config.load(args.params)  # every check happens before anything is written
    # the data source checks its own files (an archive, a folder) first; a folder's last check is reused
    desc = data.describe(cfg.data, _last(Path(args.data_source)))
    env.check_queue(config.project_root(Path.cwd()), os.environ.get("DVC_EXP_NAME"))
    info = env.probe()
    device = env.resolve_device(cfg.device, info, {v.precision for v in cfg.variants.values()})
    model = models.check(cfg.model, num_classes=desc["num_classes"],
                         image_size=models.input_size(cfg.model, desc["image_size"]))
    placement, why = env.choose_placement(
        cfg.data.placement, data.resident_bytes(desc, cfg.train.augment),
        optim.training_bytes(model["param_shapes"], cfg.train), desc, device, info)
    workers = config.resolve_workers(cfg.data.workers, env.usable_cores(), cfg.distributed.nproc_per_node)
    shm = None
    if placement == "stream":
        nproc, side = cfg.distributed.nproc_per_node, desc["image_size"]
        batch = -(-max(cfg.train.batch_size, cfg.train.eval_batch_size) // nproc)  # one rank's share
        shm = env.check_shared_memory(workers, data.stream.PREFETCH, batch * (3 * side * side + 8), nproc)
    source = models.source_record(cfg.model)  # the factory imported and hashed once, for the plans and the sweep
    plans = {name: runplan.make_plan(cfg, name, device, source["factory_source"], placement, workers)
             for name in cfg.variants}
    env.check_distributed(cfg.distributed, device, info, {p.grad_comm for p in plans.values() if p.ddp})
    models.check_unused(model, cfg.model, cfg.distributed, any(p.ddp for p in plans.values()))
    size = models.input_size(cfg.model, desc["image_size"])
    censuses, census_warnings = census(cfg, device, size, desc["num_classes"])
    for warning in env.warnings_for(info) + precision.notes({v.precision for v in cfg.variants.values()},
                                                              info["gpu"]) + census_warnings \
            + data.folder.bad_file_lines(desc) + ([shm] if shm else []):
        print(f"warning: {warning}")
    if cfg.mlflow.enabled:
        uri = config.tracking_uri(cfg.mlflow, Path.cwd())
        if uri.split(":", 1)[0].split("+", 1)[0] in env.DATABASES:
            print(f"warning: MLflow tracking store {config.redact(uri)} is a database this machine would write to "
                  "directly (running MLflow's schema migrations, keeping artifacts on its own disk); for a team, "
                  "run one `mlflow server --serve-artifacts` on it and point every machine at that server's "
                  "http:// address (README, For a team)")
        problem = env.check_tracking_server(uri)
        if problem:
            print(f"warning: MLflow tracking store {config.redact(uri)} {problem}. Training will run and keep its "
                  "results on disk; log them later with `ampbench mlflow-sync`, or set mlflow.enabled: false")
    gpu = info["gpu"]
    print(f"env_check: device {device}" + (f" ({gpu['name']}, sm {gpu['capability']})" if gpu else "")
          + f", torch {info['torch']}, variants: {', '.join(plans)}"
          + (f", {cfg.distributed.nproc_per_node} processes per machine (torchrun, "
             f"{config.resolve_backend(cfg.distributed, device)})" if cfg.distributed.nproc_per_node > 1 else ""))
    print(f"env_check: model {model['model']} ({model['param_count']:,} parameters), data {cfg.data.source}: "
          f"{desc['train_count']:,} train / {desc['test_count']:,} test images, {desc['num_classes']} classes")
    print(f"env_check: data placement {placement} ({why})"
          + (f", {workers} DataLoader worker(s) per process" if placement == "stream" else ""))

    # an estimate around training: a model the counter cannot follow still trains, and the report says why
    # counted once per model and params on this machine: kept in the user's cache folder ($XDG_CACHE_HOME/ampbench)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ampbench"
    counted, not_counted = analysis("roofline", model["model"], roofline.record_cached, cfg,
                                    gpu["name"] if gpu else None,
                                    {k: desc[k] for k in ("num_classes", "image_size")}, cache, optim.for_count)
    counted = counted or {"error": not_counted}
    for p, found in censuses.items():  # roofline.json keeps each converting rung's census under its name
        counted[p] = found
        if not found.get("error"):
            print(f"env_check: {precision.rung(p).census_summary(found)}")
    if counted.get("gpu"):
        t = counted["gpu"]["table"]
        print(f"env_check: roofline on {counted['gpu']['name']} at batch {counted['batch']}: "
              + ", ".join(f"{p} {r['vs_fp32']:.2f}x fp32" for p, r in t.items() if r and p != "fp32"))

    atomic_write(Path(args.env), json.dumps(info, indent=2, sort_keys=True) + "\n")
    atomic_write(Path(args.roofline), json.dumps(counted, indent=2, sort_keys=True) + "\n")
    # what the data stage makes: not how training places it (a placement change does not prepare the set again)
    made = {k: v for k, v in config.to_dict(cfg.data).items()
            if k not in ("placement", "workers") and (k != "bad_files" or cfg.data.source == "folder")}
    if cfg.data.source == "folder" and placement == "stream":
        made["form"] = "files"  # a streamed folder is listed, not decoded into data/prepared (not stored twice)
    atomic_write(Path(args.data_source), json.dumps({"data": made, "seed": cfg.seed, **desc},
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
