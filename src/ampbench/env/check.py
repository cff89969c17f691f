"""The env_check stage's library: params.yaml checked against this machine, the model and the data, and what
the pipeline's later stages read written only once everything passed.

    check.run("params.yaml", check.Outputs(env=..., plans=..., data_source=..., model_source=..., roofline=...))

``check`` validates (params.yaml, the data source's files, the DVC queue, the device, the model on two images,
the data placement and shared memory, DDP, what a converting precision converts) and writes nothing; ``say``
prints what was found; ``write`` writes env.json, one plan per variant, what the data stage makes, the model's
source and the roofline. The one module of ``env`` that reads the others (data, models, the op counter): the
stage around it parses paths.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ampbench import config, data, models, precision, results, runplan
from ampbench.config import optim
from ampbench.data import stream
from ampbench.env import machine, placement, services
from ampbench.errors import analysis
from ampbench.measure import roofline
from ampbench.results import atomic_write


@dataclass(frozen=True)
class Outputs:
    env: Path            # env.json: the machine, deterministic
    plans: Path          # one <variant>.json plan per variant
    data_source: Path    # what the data stage makes
    model_source: Path   # the model's source (the sweep's dep)
    roofline: Path       # the model's roofline and census (the report's dep)


@dataclass
class Checked:
    """Everything ``check`` found, for ``say`` and ``write``."""
    cfg: config.Config
    desc: dict                        # the data set: classes, image size, counts
    info: dict                        # env.json
    device: str
    model: dict                       # models.check: name, parameters, shapes
    placement: str
    why: str                          # why that placement
    workers: int
    source: dict                      # the model's source record
    plans: dict[str, runplan.RunPlan]
    censuses: dict[str, dict]         # what each converting rung converts, by rung
    warnings: list[str] = field(default_factory=list)


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
            precision.rung(v.precision).check(name, v.recipe or None, device)
    model = models.build_meta(cfg.model, num_classes=num_classes, image_size=image_size)
    found, warnings = {}, []
    for p in used:
        rung = precision.rung(p)
        counted, why = analysis("fp8_census", models.name(cfg.model), rung.census, model, runplan.recipe(cfg, p),
                                image_size, cfg.model.convert_ends)
        if counted is None:  # training converts the model itself; the report says what could not be counted
            found[p] = {"error": why}
            continue
        warnings += rung.check_batches(counted, micro_batches(cfg, p), device)
        warnings += rung.warnings(counted, runplan.compiled(cfg, p, device), device, models.name(cfg.model))
        found[p] = counted
    return found, warnings


def _last(path: Path) -> dict | None:
    """The last data_source.json this stage wrote, if any (a folder's header check is reused when unchanged)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def check(params: Path, last_data_source: Path) -> Checked:
    """Every check, in the order that stops soonest; nothing written. A ConfigError, DataError or
    EnvironmentMismatch names the bad value and the fix."""
    cfg = config.load(params)
    # the data source checks its own files (an archive, a folder) first; a folder's last check is reused
    desc = data.describe(cfg.data, _last(last_data_source))
    services.check_queue(config.project_root(Path.cwd()), os.environ.get("DVC_EXP_NAME"))
    info = machine.probe()
    precisions = {v.precision for v in cfg.variants.values()}
    device = machine.resolve_device(cfg.device, info, precisions)
    size = models.input_size(cfg.model, desc["image_size"])
    model = models.check(cfg.model, num_classes=desc["num_classes"], image_size=size)
    where, why = placement.choose_placement(
        cfg.data.placement, data.resident_bytes(desc, cfg.train.augment),
        optim.training_bytes(model["param_shapes"], cfg.train, model["frozen_shapes"]), desc, device, info)
    workers = config.resolve_workers(cfg.data.workers, placement.usable_cores(), cfg.distributed.nproc_per_node)
    shm = None
    if where == "stream":
        nproc, side = cfg.distributed.nproc_per_node, desc["image_size"]
        batch = -(-max(cfg.train.batch_size, cfg.train.eval_batch_size) // nproc)  # one rank's share
        shm = placement.check_shared_memory(workers, stream.PREFETCH, batch * (3 * side * side + 8), nproc)
    source = models.source_record(cfg.model)  # the factory imported and hashed once, for the plans and the sweep
    plans = {name: runplan.make_plan(cfg, name, device, source["factory_source"], where, workers)
             for name in cfg.variants}
    machine.check_recipes(device, info, plans)
    machine.check_distributed(cfg.distributed, device, info, {p.grad_comm for p in plans.values() if p.ddp})
    models.check_unused(model, cfg.model, cfg.distributed, any(p.ddp for p in plans.values()))
    censuses, census_warnings = census(cfg, device, size, desc["num_classes"])
    weights_note = models.finetune.input_note(cfg.model, size)
    warnings = machine.warnings_for(info) + precision.notes(precisions, info["gpu"]) + census_warnings \
        + ([weights_note] if weights_note else []) \
        + data.folder.bad_file_lines(desc) + ([shm] if shm else []) + tracking_warnings(cfg)
    return Checked(cfg, desc, info, device, model, where, why, workers, source, plans, censuses, warnings)


def tracking_warnings(cfg: config.Config) -> list[str]:
    """What to say of the MLflow tracking store before training logs to it (it is never a reason to stop)."""
    if not cfg.mlflow.enabled:
        return []
    waiting = results.pending_line(config.project_root(Path.cwd()))
    out = [waiting] if waiting else []
    uri = config.tracking_uri(cfg.mlflow, Path.cwd())
    if uri.split(":", 1)[0].split("+", 1)[0] in services.DATABASES:
        out.append(f"MLflow tracking store {config.redact(uri)} is a database this machine would write to directly "
                   "(running MLflow's schema migrations, keeping artifacts on its own disk); for a team, run one "
                   "`mlflow server --serve-artifacts` on it and point every machine at that server's http:// "
                   "address (docs/team.md)")
    problem = services.check_tracking_server(uri, experiment=cfg.mlflow.experiment)  # with this account's right
    if problem:
        out.append(f"MLflow tracking store {config.redact(uri)}: {problem}. Training will run and keep its results "
                   "on disk; log them later with `ampbench mlflow-sync`, or set mlflow.enabled: false")
    return out


def say(c: Checked) -> None:
    """What was found, on the terminal: the warnings, the device, the model and the data, the placement."""
    for warning in c.warnings:
        print(f"warning: {warning}")
    cfg, gpu = c.cfg, c.info["gpu"]
    nproc = cfg.distributed.nproc_per_node
    print(f"env_check: device {c.device}" + (f" ({gpu['name']}, sm {gpu['capability']})" if gpu else "")
          + f", torch {c.info['torch']}, variants: {', '.join(c.plans)}"
          + (f", {nproc} processes per machine (torchrun, {config.resolve_backend(cfg.distributed, c.device)})"
             if nproc > 1 else ""))
    trained = c.model["trainable_param_count"]
    params = f"{c.model['param_count']:,} parameters" if trained == c.model["param_count"] else \
        f"{trained:,} of {c.model['param_count']:,} parameters trained"
    print(f"env_check: model {c.model['model']} ({params}), data {cfg.data.source}: "
          f"{c.desc['train_count']:,} train / {c.desc['test_count']:,} test images, {c.desc['num_classes']} classes")
    sharded = [name for name, plan in c.plans.items() if plan.strategy == "fsdp" and plan.ddp]
    if sharded and nproc > 1:
        found = c.model["fsdp_blocks"]
        print(f"env_check: FSDP ({', '.join(sharded)}) shards each of {len(found)} blocks on its own, then the root: "
              + ", ".join(found[:8]) + (f", ... ({len(found) - 8} more)" if len(found) > 8 else ""))
    print(f"env_check: data placement {c.placement} ({c.why})"
          + (f", {c.workers} DataLoader worker(s) per process" if c.placement == "stream" else ""))


def count(c: Checked, cache: Path | None) -> dict:
    """roofline.json: the model's step counted per precision and its table on this GPU (an estimate around
    training: a model the counter cannot follow still trains, and the report says why), kept in ``cache`` per
    model and params; each converting rung's census under its name."""
    gpu = c.info["gpu"]
    counted, not_counted = analysis("roofline", c.model["model"], roofline.record_cached, c.cfg,
                                    gpu["name"] if gpu else None,
                                    {k: c.desc[k] for k in ("num_classes", "image_size")}, cache, optim.for_count)
    counted = counted or {"error": not_counted}
    for p, found in c.censuses.items():
        counted[p] = found
        if not found.get("error"):
            print(f"env_check: {precision.rung(p).census_summary(found)}")
    if counted.get("gpu"):
        t = counted["gpu"]["table"]
        print(f"env_check: roofline on {counted['gpu']['name']} at batch {counted['batch']}: "
              + ", ".join(f"{p} {r['vs_fp32']:.2f}x fp32" for p, r in t.items() if r and p != "fp32"))
    return counted


def write(c: Checked, counted: dict, out: Outputs) -> None:
    """What the later stages read; stale plans (a variant no longer in params.yaml) removed."""
    atomic_write(Path(out.env), json.dumps(c.info, indent=2, sort_keys=True) + "\n")
    atomic_write(Path(out.roofline), json.dumps(counted, indent=2, sort_keys=True) + "\n")
    # what the data stage makes: not how training places it (a placement change does not prepare the set again)
    made = {k: v for k, v in config.to_dict(c.cfg.data).items()
            if k not in ("placement", "workers") and (k != "bad_files" or c.cfg.data.source == "folder")}
    if c.cfg.data.source == "folder" and c.placement == "stream":
        made["form"] = "files"  # a streamed folder is listed, not decoded into data/prepared (not stored twice)
    atomic_write(Path(out.data_source), json.dumps({"data": made, "seed": c.cfg.seed, **c.desc},
                                                   indent=2, sort_keys=True) + "\n")
    atomic_write(Path(out.model_source), json.dumps(c.source, indent=2, sort_keys=True) + "\n")
    plan_dir = Path(out.plans)
    plan_dir.mkdir(parents=True, exist_ok=True)
    for stale in plan_dir.glob("*.json"):
        if stale.stem not in c.plans:
            stale.unlink()
    for name, plan in c.plans.items():
        runplan.write_plan(plan, plan_dir / f"{name}.json")


def run(params: Path, out: Outputs) -> None:
    """The stage: check, say, count (cached in $XDG_CACHE_HOME/ampbench), write."""
    checked = check(Path(params), Path(out.data_source))
    say(checked)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ampbench"
    write(checked, count(checked, cache), out)
