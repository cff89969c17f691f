"""Running one variant: epochs with checkpoints, Ctrl-C at a step boundary, repeats over seeds.

``train(plan, data)`` returns a ``metrics.RunResult``; writing it to disk is the
caller's job (see ``results``). With a checkpoint folder, the run saves its
state after every epoch and on Ctrl-C, and resumes from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from ampbench import runplan
from ampbench.config import to_dict
from ampbench.errors import Aborted, AmpbenchError, NonFiniteTraining, quiet_if_orphaned
from ampbench.measure import stats
from ampbench.runplan import RunPlan
from ampbench.train import checkpoint, distributed, fsdp, numerics, profiling, setup
from ampbench.train.engine import Trainer
from ampbench.train.metrics import RunResult, run_result


class TrainingInterrupted(AmpbenchError):
    """Ctrl-C or SIGTERM: the run stopped at a step boundary with a checkpoint saved; exit code 128 + the signal."""

    exit_code = 128 + signal.SIGINT

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C; a scheduler's stop (Slurm, docker stop, Kubernetes)


@contextmanager
def stop_on_signal(trainer: Trainer):
    """The first Ctrl-C or SIGTERM: finish the current step, then stop with a checkpoint; a second interrupts at once.

    SIGTERM is how Slurm at a time limit, ``docker stop``, Kubernetes and systemd stop a job, with a grace period
    before SIGKILL: it stops as Ctrl-C does. Under torchrun, which passes the signal on to every rank (and kills
    them after its grace), the ranks stop after the same step, within two votes of the signal (``StopVote``).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        quiet_if_orphaned()  # a SIGTERM for the parent's death (DVC's): nobody reads the pipes any more
        if trainer.stop_requested:  # the second: at once, as the signal says (Ctrl-C 130, SIGTERM 143)
            raise KeyboardInterrupt if signum == signal.SIGINT else Aborted(signum)
        trainer.stop_requested = True
        trainer.stop_signal = signum
        if trainer.world.main:
            when = "within the ranks' next two votes" if trainer.world.active else "after this step"
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            # one write to the file descriptor: a print (or tqdm.write) here would re-enter the stdout buffer a
            # signal may have interrupted mid-write ("reentrant call inside BufferedWriter")
            with contextlib.suppress(OSError, ValueError):
                os.write(sys.stdout.fileno(), f"\n{name}: stopping {when} and saving a checkpoint (again to "
                                              "abort)\n".encode())

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def train(plan: RunPlan, data: dict, *, progress: bool = True, checkpoint_dir: Path | None = None,
          profile: bool = True, world: distributed.World = distributed.SINGLE) -> RunResult:
    """Train one variant for ``plan.train.epochs`` epochs and measure it, resuming from a checkpoint if any.

    After training (never inside a timed step) come the fp16 numerics audit and the step profile. Under
    torchrun every rank runs this; rank 0 alone writes the checkpoints, and every rank resumes from them.
    """
    trainer = Trainer(plan, data, progress=progress, world=world)
    # the worker count does not change the batches: a checkpoint resumes under any
    fp = checkpoint.fingerprint({**to_dict(plan), "model": runplan.model_dict(plan.model), "workers": None,
                                 "world_size": world.size}, data["meta"])
    state = checkpoint.load(checkpoint_dir, fp, discard=world.main)
    distributed.check_agree(world, "the checkpoint to resume from",
                            None if state is None else (state["epoch"], state["global_step"]))
    if state is not None:
        trainer.load_state_dict(state)
        if world.main:
            print(f"[{plan.variant}] resuming from the checkpoint at epoch {trainer.epoch + 1}, "
                  f"step {trainer.step_in_epoch} of {trainer.steps_per_epoch}", flush=True)
    try:
        with stop_on_signal(trainer), torch.autograd.set_detect_anomaly(plan.debug.detect_anomaly):
            while trainer.epoch < plan.train.epochs:
                trainer.run_epoch()
                if checkpoint_dir is not None:
                    state = trainer.state_dict()  # on every rank: it sums over them
                    if world.main:
                        checkpoint.save(checkpoint_dir, {**state, "fingerprint": fp})
                if trainer.stop_now():
                    where = f"epoch {trainer.epoch + 1}, step {trainer.step_in_epoch}"
                    saved = f"checkpoint saved in {checkpoint_dir}; run `dvc repro` to resume" if checkpoint_dir \
                        else "no checkpoint folder was given, so the run cannot resume"
                    raise TrainingInterrupted(f"[{plan.variant}] interrupted at {where}: {saved}",
                                              trainer.agreed_signal())
    except NonFiniteTraining as err:
        err.result = run_result(trainer)  # completed epochs, for the stage to keep on disk
        err.result.metrics.update(status="stopped: non-finite loss", diagnosis=trainer.diagnosis)
        raise
    except RuntimeError as err:
        if not plan.debug.detect_anomaly or "nan" not in str(err).lower():
            raise
        stopped = NonFiniteTraining(f"[{plan.variant}] torch.autograd.detect_anomaly: {str(err).splitlines()[0]}")
        stopped.result = run_result(trainer)
        stopped.result.metrics.update(status="stopped: detect_anomaly", diagnosis={"anomaly": str(err)[:2000]})
        raise stopped from None
    trainer.stop_vote.close()  # trained: no stop vote left in flight
    result = run_result(trainer)
    sharded = fsdp.is_sharded(trainer.model)
    # the weights as trained (the profile below takes further steps); under FSDP gathered whole (every rank's call)
    trained = checkpoint.plain_state(fsdp.full_state(trainer.model)[0] if sharded else trainer.model.state_dict())
    if world.main:
        result.weights = {k: v.detach().to("cpu", copy=True) for k, v in trained.items()}
    if sharded:
        result.metrics["fsdp"] = fsdp.describe(trainer.model, trainer.opt, world.size, plan,
                                               trainer.setup.compiled_blocks)
    # analyses after training (never inside a timed step): one that fails is a warning and a line in the report
    if plan.amp and plan.amp.audit_batches and world.main:  # on rank 0's model (a whole copy of a sharded one)
        audit = list(itertools.islice(trainer.train_batches.epoch(0), plan.amp.audit_batches))
        model = setup.whole_copy(trainer.setup, trainer.data_meta, trainer.device, trained) if sharded \
            else trainer.model
        result.numerics = trainer.analysis("audit", numerics.audit, model, audit, trainer.ledger.last_scale,
                                           trainer.device.type) or []
    if profile and plan.profile.steps:
        if progress and world.main:
            tqdm.write(f"[{plan.variant}] profiling {plan.profile.steps} steps (torch.profiler, after the timed steps)")
        found = trainer.analysis("profile", profiling.profile_run, trainer, plan.profile.steps)
        result.metrics["profile"], result.profile_trace = found or ({"error": trainer.not_made["profile"]}, "")
    result.metrics["not_made"] = dict(trainer.not_made)  # analysis -> why it could not be made: the report says
    return result


REPEATED = ("imgs_per_s", "compute_imgs_per_s", "final_acc", "best_acc", "final_loss", "achieved_tflops",
            "epoch_time_s")


def train_repeats(plan: RunPlan, data: dict, *, progress: bool = True,
                  checkpoint_dir: Path | None = None, world: distributed.World = distributed.SINGLE) -> RunResult:
    """Train ``plan.train.repeats`` times with seeds seed, seed+1, ...; mean and spread across them.

    The first repeat's history is the run's history; step times are pooled.
    Each repeat checkpoints in its own subfolder, so a resumed stage skips the
    repeats already done.
    """
    runs = []
    for i in range(plan.train.repeats):
        if progress and plan.train.repeats > 1 and world.main:
            tqdm.write(f"[{plan.variant}] repeat {i + 1}/{plan.train.repeats} (seed {plan.seed + i})")
        ckpt = Path(checkpoint_dir) / f"repeat{i + 1}" if checkpoint_dir is not None else None
        runs.append(train(dataclasses.replace(plan, seed=plan.seed + i), data, progress=progress,
                          checkpoint_dir=ckpt, profile=i == 0, world=world))  # one profile: the first seed's
    out = dataclasses.replace(runs[0], metrics=dict(runs[0].metrics),
                              step_times_ms=[t for r in runs for t in r.step_times_ms],
                              step_rates=[t for r in runs for t in r.step_rates])
    m = out.metrics
    for key in REPEATED:
        values = [r.metrics[key] for r in runs if r.metrics.get(key) is not None]
        mean, std = stats.mean_std(values) if values else (None, None)
        m[key], m[f"{key}_std"], m[f"{key}_runs"] = mean, (std if len(values) > 1 else None), values
    m["repeats"] = len(runs)
    m["seeds"] = [plan.seed + i for i in range(len(runs))]
    m["skipped_steps"] = sum(r.metrics["skipped_steps"] for r in runs)
    m["step_time_ms"] = stats.summarize_ms(out.step_times_ms)
    m["imgs_per_s_p10_p90"] = stats.rate_spread(out.step_rates)
    for key in ("peak_mem_bytes", "peak_reserved_bytes"):
        values = [r.metrics[key] for r in runs if r.metrics.get(key) is not None]
        m[key] = max(values) if values else None
    return out
