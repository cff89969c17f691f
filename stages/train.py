"""Stage train@<variant>: train one variant with the shared engine; write its run files; log to MLflow.

    python stages/train.py --nproc-per-node 1 --plan reports/plans/amp.json --data data/prepared \
        --env reports/env.json --out reports/runs/amp --checkpoints checkpoints/amp

With ``--nproc-per-node N`` over 1 it runs ``torchrun --standalone --nproc-per-node N stages/train.py ...``'s
elastic agent in this process (so a signal to it reaches the agent), and ends with a rank's own message rather than
torchrun's traceback; with 1 it trains in this process, without torchrun's own start-up and a second interpreter.
Under torchrun with several processes, each trains on its slice of every batch (DDP) and rank 0 alone
writes the run files, the checkpoints and the MLflow run; a variant with
``ddp: false`` trains on rank 0 alone while the other ranks exit at once.

An interrupted run (Ctrl-C, a crash, a killed process) resumes from its last
checkpoint when the stage runs again; the checkpoints are cleared once the
results are on disk.
"""

import argparse
import json
import os
import sys
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

import _here  # noqa: F401  ampbench from this repository's src (stages/_here.py)

from ampbench import config, data, models, results, runplan
from ampbench.errors import NonFiniteTraining, run_cli
from ampbench.measure import sysmon
from ampbench.train import checkpoint, distributed, metrics, runner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="the variant's plan, written by env_check")
    ap.add_argument("--data", required=True, help="the prepared data folder")
    ap.add_argument("--env", required=True, help="env.json, written by env_check")
    ap.add_argument("--out", required=True, help="folder for this variant's run files")
    ap.add_argument("--checkpoints", required=True, help="folder for this variant's checkpoints (kept until done)")
    ap.add_argument("--params", default="params.yaml", help="where the tracking settings (mlflow:) are read: "
                    "not part of the plan, so pointing at another tracking server retrains nothing")
    ap.add_argument("--nproc-per-node", type=int, default=1,
                    help="training processes (distributed.nproc_per_node): over 1, this runs itself under torchrun")
    args = ap.parse_args()
    if args.nproc_per_node > 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        print(f"torchrun --standalone --nproc-per-node {args.nproc_per_node} {' '.join(sys.argv)}", flush=True)
        distributed.torchrun(args.nproc_per_node, sys.argv)  # its agent in this process: Ctrl-C and kills reach it
        return

    plan = runplan.read_plan(args.plan)
    distributed.exit_with_launcher()
    launch = distributed.launched()
    if not plan.ddp and launch.size > 1:
        if launch.rank:
            return  # ddp: false: rank 0 trains alone
        world = distributed.SINGLE
    else:
        world = distributed.init(plan.backend, plan.device)
    try:
        train(plan, args, world)
    finally:
        distributed.shutdown()


def train(plan: runplan.RunPlan, args: argparse.Namespace, world: distributed.World) -> None:
    info = json.loads(Path(args.env).read_text())
    prepared = data.load_prepared(Path(args.data), plan.device, stream=plan.placement == "stream")
    out = Path(args.out)
    if world.main:  # what a crash mid-write left in the run folder: never a result, never an extra DVC output
        results.remove_temporaries(out, results.RUN_TEMPORARIES)
    monitor = sysmon.SystemMonitor(interval_s=0.5, gpu_uuid=sysmon.device_uuid(world.device(plan.device)))
    started = datetime.now(UTC).isoformat(timespec="milliseconds")  # the order the variants ran in; MLflow's start
    try:
        with monitor if world.main else nullcontext():
            result = runner.train_repeats(plan, prepared, checkpoint_dir=Path(args.checkpoints), world=world)
    except NonFiniteTraining as err:  # keep what the completed epochs measured, with the diagnosis
        if err.result is not None and world.main:
            err.result.system, err.result.system_samples = monitor.snapshot()
            err.result.metrics.update(started_at=started, dataset=data.record(Path(args.data), prepared["meta"]))
            save(plan, err.result, info, out, Path(args.plan).parent, Path(args.env), args.params,
                 prepared["meta"])
        raise
    if not world.main:
        return
    result.system, result.system_samples = monitor.snapshot()
    result.metrics.update(started_at=started, dataset=data.record(Path(args.data), prepared["meta"]))
    save(plan, result, info, out, Path(args.plan).parent, Path(args.env), args.params, prepared["meta"])
    checkpoint.clear(Path(args.checkpoints))
    procs = f" over {world.size} processes ({world.backend})" if world.active else ""
    print(f"train@{plan.variant}: final accuracy {result.metrics['final_acc']:.4f}, "
          f"{result.metrics['imgs_per_s'] or 0:.0f} img/s{procs} -> {out}")


def save(plan: runplan.RunPlan, result: metrics.RunResult, info: dict, out: Path, plans_dir: Path,
         env_path: Path, params: str = "params.yaml", prepared_meta: dict | None = None) -> None:
    """Write the run's files, then log them to MLflow: results are on disk first, tracking only adds."""
    result.metrics["git_commit"] = results.git_commit()
    result.metrics["finished_at"] = datetime.now(UTC).isoformat(timespec="milliseconds")
    result.metrics["command"] = " ".join(sys.argv)  # the stage's command line: the MLflow run's source
    # rank 0's GPU: median SM clock, temperature and power over the stage, energy per image (its power over its
    # own share of the throughput)
    result.metrics.update(sysmon.summary(result.system, result.metrics.get("imgs_per_s_per_process"),
                                         result.system_samples))
    result.metrics["env_fingerprint"] = results.fingerprint(info)
    model = None
    if result.weights is not None:  # with what rebuilds the module: ampbench's models.build, or the user's factory
        model = {"state_dict": result.weights, "model": config.to_dict(plan.model), "model_source": plan.model_source,
                 "num_classes": prepared_meta["num_classes"],
                 "image_size": models.input_size(plan.model, prepared_meta["image_shape"][-1]),
                 "precision": plan.precision}
    results.write_run(out, result.metrics, result.tables(), result.step_times_ms, result.profile_trace, model)
    tracking_cfg = config.load(params).mlflow if Path(params).is_file() else config.MlflowConfig()
    if tracking_cfg.enabled:
        from ampbench import tracking
        pipeline = tracking.pipeline_id(plans_dir, env_path)
        tracking.safely(f"train@{plan.variant}", tracking.log_variant, tracking_cfg, Path.cwd(), out,
                        config.to_dict(plan), info, pipeline, results_of=(out / results.METRICS,))


if __name__ == "__main__":
    run_cli(main)
