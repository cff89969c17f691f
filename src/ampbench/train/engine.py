"""The one training loop, and evaluation. Every variant runs this code.

    torchrun --standalone --nproc-per-node 1 stages/train.py --plan reports/plans/amp.json ...   # train@amp

Variants differ only in data passed in: the precision policy (autocast dtype,
GradScaler) and ``accum_steps``; under torchrun, the ``World`` (see
``distributed.py``): the same loop on every rank, each on its slice of every
global batch, gradients all-reduced once per optimizer step. One optimizer step
is ``step.train_step``. ``Trainer.run_epoch`` is the loop; ``runner.train``
drives it epoch by epoch with checkpoints and Ctrl-C handling.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ampbench import models
from ampbench.config import micro_batch
from ampbench.data.batches import Batches, DeviceBatches
from ampbench.data.stream import StreamBatches
from ampbench.errors import NonFiniteTraining, analysis
from ampbench.measure import clock, flops, memory, sysmon
from ampbench.precision import tf32_flags
from ampbench.runplan import RunPlan
from ampbench.train import checkpoint, distributed, fsdp, ledger, numerics, probes, setup, step
from ampbench.train.policy import PrecisionPolicy


def make_batches(plan: RunPlan, data: dict, world: distributed.World = distributed.SINGLE) -> tuple[Batches, Batches]:
    """The training and evaluation batches in the plan's placement: resident on the device, or streamed to it
    (``data`` then holds the prepared set in host memory, ``load_prepared(..., stream=True)``)."""
    meta = data["meta"]
    common = dict(mean=meta["mean"], std=meta["std"], channels_last=plan.model.channels_last,
                  out_size=models.input_size(plan.model, meta["image_shape"][-1]), shard=(world.rank, world.size))
    if plan.placement == "stream":
        kind = StreamBatches
        common.update(device=world.device(torch.device(plan.device).type), workers=plan.workers)
    else:
        kind = DeviceBatches
    # the last partial batch is dropped: its new shape would autotune cuDNN (or recompile) inside a timed step
    train = kind(*data["train"], plan.train.batch_size, augment=plan.train.augment, shuffle=True,
                 drop_last=True, seed=plan.seed, **common)
    test = kind(*data["test"], plan.train.eval_batch_size, augment=False, shuffle=False, **common)
    return train, test


def evaluate(model: torch.nn.Module, batches: Batches, policy: PrecisionPolicy,
             world: distributed.World = distributed.SINGLE) -> dict:
    """Accuracy and mean loss over the evaluation set, in the variant's precision.

    Under DDP it is sharded: every rank evaluates rank 0's model (its BatchNorm statistics broadcast first) on
    its slice of each batch, and the sums are all-reduced.
    """
    distributed.broadcast_buffers(model, world)
    model.eval()
    collective = fsdp.is_sharded(model)  # each forward all-gathers: every rank runs every batch, an empty slice too
    dev = batches.device
    loss_sum = torch.zeros((), device=dev)
    correct = torch.zeros((), device=dev, dtype=torch.int64)
    n = 0
    with torch.no_grad(), policy.autocast():
        for x, y in batches.epoch(0):
            if not len(y) and not collective:
                continue
            out = model(x)
            loss_sum += F.cross_entropy(out.float(), y, reduction="sum")
            correct += (out.argmax(dim=1) == y).sum()
            n += len(y)
    model.train()
    loss_total, correct_total, n = world.reduce([loss_sum.item(), correct.item(), n])  # one sync
    return {"acc": correct_total / max(1, n), "loss": loss_total / max(1, n)}


class Trainer:
    """One variant's model, optimizer, scaler, schedule and counters, and the loop that trains them."""

    def __init__(self, plan: RunPlan, data: dict, *, progress: bool = True,
                 world: distributed.World = distributed.SINGLE):
        self.world = world
        self.plan, self.progress, self.data_meta = plan, progress and world.main, data["meta"]
        self.counts = (len(data["train"][1]), len(data["test"][1]))
        self.device = device = world.device(torch.device(plan.device).type)
        self.setup = s = setup.build(plan, data["meta"], device, world)  # model, optimizer, policy, scaler...
        if plan.train.compile and fsdp.is_sharded(s.model) and world.main:
            compiled, eager = s.compiled_blocks
            print(f"[{plan.variant}] torch.compile under FSDP: each block's forward, {len(compiled)} of "
                  f"{len(compiled) + len(eager)} blocks" + (f"; left eager: {', '.join(eager)} (each holds a BatchNorm "
                  "sharded apart in fp32, whose FSDP hooks would break its graph)" if eager else ""))
        self.policy = s.policy
        self.model = s.model
        self.opt = s.opt
        self.scaler = s.scaler
        self.input_size = s.input_size
        self.tf32 = tf32_flags()  # as build() set them
        self.train_batches, self.test_batches = make_batches(plan, data, world)
        self.steps_per_epoch = len(self.train_batches)
        self.log_norms = bool(plan.train.clip_grad_norm) or plan.train.log_grad_norm
        # skipped steps, the loss scale, the schedule, the epoch's loss: what the host knows of each step
        self.ledger = ledger.StepLedger(self.opt, self.scaler, plan.train.epochs * self.steps_per_epoch, device, world,
                                        plan.amp.max_consecutive_nonfinite if plan.amp else 1, self.log_norms,
                                        self.fail)
        self.micro = micro_batch(plan.train.batch_size, world.size, plan.accum_steps)  # per rank
        x, y = next(self.train_batches.epoch(0))
        # analyses before training (FLOPs per image: 8 suffice): one that fails is said, never fatal
        self.not_made: dict[str, str] = {}  # analysis -> why it could not be made
        plain = setup.plain_model(s, data["meta"], device)  # the model in plain arithmetic (fp8: unconverted)
        self.accum_check = self.analysis(  # on the model in plain arithmetic: what accumulation does, not fp8
            "accumulation", probes.accumulation_check, plain, x, y, self.micro) if plan.accum_steps > 1 else None
        # on the model itself; a sharded one's copy (what a forward saves is the same, and a sharded forward's
        # all-gathered weights are not activations)
        self.activation_bytes = self.analysis("activations", probes.activation_bytes,
                                              plain if fsdp.is_sharded(self.model) else self.model, x[:self.micro],
                                              self.policy)
        self.flops_per_image = self.analysis("flops", flops.train_flops_per_image, plain, x[:8], y[:8])
        # a converting rung's layers that a forward runs converted (its census of the unconverted model)
        found = self.analysis("fp8_census", self.policy.census, plain, s.input_size) if s.policy.rung.converts \
            else None
        self.layers_converted = len(found["called"]) if found else None
        del plain
        self.step_model = s.step_model
        memory.reset_peak_memory(device)  # before training: what the probes left is not training's
        # CUDA peaks by phase: steady-state training steps (from each process's second step, after cuDNN has
        # autotuned the one training shape), and evaluation apart
        self.peaks = memory.PeakWindows(device)

        # Progress; everything here (and the ledger) goes into a checkpoint.
        self.epoch = self.step_in_epoch = self.global_step = 0
        self.last_batch: tuple[torch.Tensor, torch.Tensor] | None = None
        self.diagnosis: dict | None = None
        self.history: list[dict] = []
        self.best_acc = 0.0
        self.clock = clock.StepClock(device, plan.train.warmup_steps)  # checkpointed, but for its warm-up count
        self.stop_requested = False  # Ctrl-C or SIGTERM seen by this process
        self.stop_signal = 0  # which
        self.stop_agreed = False     # under DDP: Ctrl-C or SIGTERM seen by some rank, agreed by all
        self.stop_vote = distributed.StopVote(self.world)
        self.vote_every = 1  # steps between stop votes: every step until a loss sync has timed them
        self._synced_at = (time.perf_counter(), 0)  # when the last loss sync (or the epoch) began, at which step
        self.t_start = time.perf_counter()

    def analysis(self, name: str, fn, *args):
        """``errors.analysis`` for this run (rank 0 warns): the result, or None with the reason kept."""
        with contextlib.redirect_stdout(None) if not self.world.main else contextlib.nullcontext():
            result, why = analysis(name, f"{models.name(self.plan.model)} ({self.plan.variant})", fn, *args)
        self.not_made.update({name: why} if why else {})
        return result

    # --- one optimizer step ------------------------------------------------------------------

    def optimizer_step(self, x: torch.Tensor, y: torch.Tensor, global_count: int | None = None) -> bool | None:
        """Train on one batch (of ``global_count`` images over all ranks: the epoch's current batch's where not
        given); return True if the scaler skipped the step (an inf/NaN gradient), or None where only the device
        knows yet (a fused optimizer under fp16: the ledger settles it at the next sync)."""
        if global_count is None:
            global_count = self.train_batches.global_count(self.step_in_epoch)
        n = y.shape[0]  # not len(): Tensor.__len__ is Python, per step
        self.last_batch = (x, y)  # kept (not copied) for a diagnosis if this step goes non-finite
        # this rank's share of the global batch, times the world: DDP's mean over ranks is the batch's mean
        # (exactly 1 in one process, and wherever the slices are equal)
        weight = n * self.world.size / global_count
        mark = self.ledger.mark()
        loss = step.train_step(self.step_model, self.opt, self.scaler, self.policy, x, y, self.micro, weight,
                               self.plan.train.clip_grad_norm, self.ledger.norms)
        return self.ledger.record(mark, loss, n)

    def fail(self, why: str) -> None:
        """Stop the run with a diagnosis: which module first produced inf/NaN, and which gradient."""
        x, y = self.last_batch
        self.peaks.close()  # the diagnosis's own passes are not training's
        self.opt.zero_grad(set_to_none=True)  # room for the replay's copy beside the model (training is over)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        model = self.model
        if fsdp.is_sharded(model):  # every rank stops here: each replays on a whole copy (a copy of the shards fails)
            whole = fsdp.full_state(model, everywhere=True)[0]
            model = setup.whole_copy(self.setup, self.data_meta, self.device, whole)
        with self.policy.kernels():  # its backward too
            self.diagnosis = numerics.diagnose(model, x, y, self.policy.autocast, self.ledger.last_scale or 1.0,
                                               self.opt)
        self.diagnosis["reason"] = why
        fix = numerics.advice(self.diagnosis, self.plan.precision, self.plan.train.optimizer_impl, self.ledger.skipped)
        raise NonFiniteTraining(
            f"[{self.plan.variant}] training stopped at epoch {self.epoch + 1}, step {self.step_in_epoch + 1}: "
            f"{why}. {numerics.describe(self.diagnosis)}. {fix}")

    # --- one epoch -----------------------------------------------------------------------------

    def run_epoch(self) -> dict | None:
        """Train to the end of the current epoch (or a requested stop) and evaluate; the history row."""
        plan, epoch = self.plan, self.epoch
        batches = self.train_batches.epoch(epoch, start=self.step_in_epoch)  # resumed mid-epoch: the same batches
        mean_loss = None
        bar = tqdm(total=self.steps_per_epoch, initial=self.step_in_epoch, disable=not self.progress, unit="step",
                   dynamic_ncols=True, desc=f"{plan.variant} epoch {epoch + 1}/{plan.train.epochs}")
        self.clock.begin()
        self._synced_at = (time.perf_counter(), self.global_step)  # steps timed from here (evaluation, a resume apart)
        self.peaks.open("train" if self.clock.process_steps >= 1 else "first step")
        phase = None
        # per epoch, not per step: each batch's images over all ranks, and what the loop reads of the clock
        counts = [self.train_batches.global_count(i) for i in range(self.steps_per_epoch)]
        steps, step_clock, active = self.steps_per_epoch, self.clock, self.world.active
        data_span, compute_span = step_clock.data(), step_clock.compute()
        with clock.wall_clock(self.device) as wall, contextlib.closing(self.peaks):  # a failure closes it too
            while self.step_in_epoch < steps and not (self.stop_agreed if active else self.stop_requested):
                if phase != (now := sysmon.TIMED if step_clock.process_steps >= step_clock.warmup else "warmup"):
                    sysmon.set_phase(phase := now)  # on change, not every step
                count = counts[self.step_in_epoch]  # all ranks' images
                with data_span:
                    x, y = next(batches)
                with compute_span:
                    self.optimizer_step(x, y, count)
                step_clock.step_done(count)
                if step_clock.process_steps == 1:  # the first step autotuned: the steady state starts here
                    self.peaks.close()
                    self.peaks.open("train")
                self.global_step += 1
                self.step_in_epoch += 1
                bar.update(1)
                if active and self.global_step % self.vote_every == 0:  # the same steps on every rank
                    self.stop_agreed = self.stop_agreed or self.stop_vote(self.stop_requested)
                if self.step_in_epoch % 25 == 0 or self.step_in_epoch == self.steps_per_epoch:
                    self.ledger.settle()  # gradient norms, a fused optimizer's skips: read where the loop syncs
                    mean_loss = self.mean_loss()  # a sync every 25 steps
                    bar.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{self.ledger.sched.get_last_lr()[0]:.3g}",
                                    refresh=False)  # drawn at the bar's own pace, not every 25 steps
                    # fp32/bf16 have no scaler to skip such steps; under fp16 the ledger stops a run at
                    # amp.max_consecutive_nonfinite, and this only when a whole epoch had no finite loss
                    if not math.isfinite(mean_loss) and (not self.policy.uses_scaler
                                                         or self.step_in_epoch == self.steps_per_epoch):
                        self.fail("the training loss became inf/NaN")
            ep_images, ep_ms = self.clock.end()  # the last step's cycle ends with the loop, as the others do
        sysmon.set_phase("other")  # evaluation, the checkpoint, the profile: not the timed steps
        bar.close()
        self.ledger.settle()  # a stop mid-window: before the checkpoint
        if self.step_in_epoch < self.steps_per_epoch:
            return None  # stopped mid-epoch
        # all ranks' images per wall second of the slowest rank; the ranks' scalers must agree
        ep_ms = self.world.reduce([ep_ms], "max")[0]
        self.ledger.check_scale(plan.variant)
        distributed.check_agree(self.world, "the GradScaler's scale, skipped and inf/NaN-loss steps",
                                self.ledger.agreed())
        self.peaks.open("eval")
        ev = evaluate(self.model, self.test_batches, self.policy, self.world)
        self.peaks.close()
        self.best_acc = max(self.best_acc, ev["acc"])
        train_loss = mean_loss if mean_loss is not None else self.mean_loss()  # the last step's sync has it
        row = {"epoch": epoch + 1, "train_loss": train_loss, "eval_loss": ev["loss"],
               "eval_acc": ev["acc"], "lr": self.ledger.sched.get_last_lr()[0], "loss_scale": self.ledger.last_scale,
               "skipped_steps": self.ledger.skipped, "epoch_time_s": wall["s"],
               "imgs_per_s": ep_images / (ep_ms / 1000) if ep_ms else None}
        self.history.append(row)
        self.epoch, self.step_in_epoch = epoch + 1, 0
        self.ledger.new_epoch()
        if self.progress:
            done = self.global_step / (plan.train.epochs * self.steps_per_epoch)
            eta = (time.perf_counter() - self.t_start) * (1 - done) / max(done, 1e-9)
            ips = f"{row['imgs_per_s']:.0f} img/s" if row["imgs_per_s"] else "warm-up"
            tqdm.write(f"[{plan.variant}] epoch {epoch + 1}/{plan.train.epochs}: train loss {row['train_loss']:.4f}, "
                       f"eval acc {ev['acc']:.4f}, {ips}, {wall['s']:.1f}s, ETA {eta:.0f}s")
        return row

    def agreed_signal(self) -> int:
        """The signal a stop answers, the same on every rank (one collective, at a stop): a rank the vote stopped,
        which saw no signal itself, exits as the rank that saw one (128 + its number), not with 128."""
        return int(self.world.reduce([float(self.stop_signal)], "max")[0]) or signal.SIGINT

    def stop_now(self) -> bool:
        """Stop after this step (Ctrl-C, SIGTERM): at once in one process; under DDP once the ranks agree on it (within
        two votes, about 0.1 s of training: ``distributed.StopVote``)."""
        return self.stop_agreed if self.world.active else self.stop_requested

    def mean_loss(self) -> float:
        """This epoch's mean training loss so far, over all ranks (one sync, every 25 steps); NaN when every step's
        loss so far was inf/NaN (left out of the sum), so the loop's inf/NaN stop fires.

        Under DDP the same all-reduce also carries whether any rank has seen a stop signal (beside the stop votes),
        and the ranks' step time since the last sync, which sizes the steps between votes (``StopVote.every``).
        """
        then, at = self._synced_at
        now = time.perf_counter()
        step_s = (now - then) / (self.global_step - at) if self.global_step > at else 0.0
        total, seen, stop, step_sum = self.world.reduce([self.ledger.loss_sum.item(), self.ledger.seen,
                                                         float(self.stop_requested), step_s])
        self.stop_agreed = self.stop_agreed or stop > 0
        self._synced_at = (now, self.global_step)
        if step_sum > 0:  # the ranks' mean step time since the last sync: the same figure on every rank
            self.vote_every = distributed.StopVote.every(step_sum / self.world.size)
        return total / seen if seen else math.nan  # no image counted (every loss inf/NaN): not a loss of 0

    # --- checkpoints ---------------------------------------------------------------------------

    _SCALARS = ("epoch", "step_in_epoch", "global_step", "history", "best_acc")

    def state_dict(self) -> dict:
        """The whole training state; under DDP every rank calls it (the epoch's loss sum and image count are summed
        over the ranks and resume on rank 0; the clock counts every rank's images already), and rank 0 writes it."""
        state = {**{k: getattr(self, k) for k in self._SCALARS}, **self.ledger.state_dict()}
        peaks = self.peaks.from_flat(self.world.reduce(self.peaks.flat(), "max"))  # every rank's largest
        model, opt = fsdp.full_state(self.model, self.opt) if fsdp.is_sharded(self.model) else (
            self.model.state_dict(), self.opt.state_dict())  # FSDP: whole, on rank 0
        model = checkpoint.plain_state(model)  # a subclass's tensors (MX's, fp8's under FSDP) as the plain they hold
        state.update(clock=self.clock.state_dict(), peaks=peaks, model=model, opt=opt, scaler=self.scaler.state_dict(),
                     rng_cpu=torch.get_rng_state(),
                     rng_cuda=torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None)
        return state

    def load_state_dict(self, state: dict) -> None:
        for k in self._SCALARS:
            setattr(self, k, state[k])
        self.clock.load_state_dict(state["clock"])
        self.peaks.load_state_dict(state["peaks"])
        self.setup.load_state(state["model"], state["opt"], state["scaler"])
        self.ledger.load_state_dict(state, self.global_step)
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(state["rng_cuda"])
