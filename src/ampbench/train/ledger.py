"""The step ledger: what the host knows of each optimizer step, kept without a host sync of its own.

fp16 makes this bookkeeping: GradScaler skips a step whose gradients overflowed, so the loop must count the steps
taken (``TakenSteps``), follow the loss scale they imply (``HostScale``), advance the learning-rate schedule only on
a step taken (``schedule.py``: on the host, or on the device where only the device knows), count inf/NaN losses
in a row (stopping at amp.max_consecutive_nonfinite), and keep the epoch's loss sum. ``StepLedger`` owns all of it:
the trainer marks a step before it (``mark``), records it after (``record``), and ``settle``s at the syncs its loop
makes anyway, where the gradient norms and a fused optimizer's skips are read, and the steps' losses summed.
"""

from __future__ import annotations

import inspect
import math
import struct
import weakref
from collections.abc import Callable

import torch

from ampbench.train import distributed
from ampbench.train.schedule import schedule, skips_on_device


class TakenSteps:
    """Counts the optimizer steps really taken, with no host sync of its own.

    ``GradScaler.step`` checks the unscaled gradients for inf/NaN (its one sync, an ``.item()``) and calls
    ``optimizer.step()`` only when there were none, so a post-step hook on the optimizer sees exactly the steps
    taken: a step whose count did not move was skipped. A disabled scaler always steps.

    A fused optimizer breaks this: GradScaler hands it the found-inf flag on the device (``opt.found_inf``) and
    its ``step()`` always runs, skipping the update on the device, with no sync at all. A pre-step hook keeps that
    flag (``found_inf``); the ledger then follows the LR schedule on the device (``DeviceSchedule``) and reads the
    flags, with the counters they drive, at the loop's next sync (``StepLedger.settle``).
    """

    def __init__(self, opt: torch.optim.Optimizer):
        self.count = 0
        self.found_inf: torch.Tensor | None = None
        self._handles = (opt.register_step_pre_hook(self._before), opt.register_step_post_hook(self._taken))

    def _before(self, opt, args, kwargs) -> None:
        self.found_inf = getattr(opt, "found_inf", None)

    def _taken(self, opt, args, kwargs) -> None:
        self.count += 1


class HostScale:
    """The GradScaler's loss scale mirrored on the host from the skips, as ``torch._amp_update_scale_`` changes
    it: backoff on a skipped step, growth after ``growth_interval`` steps taken in a row. Reading the real scale
    (``get_scale``) is an ``.item()``: a second sync per step that fp32 and bf16 do not pay."""

    def __init__(self, scaler: torch.amp.GradScaler):
        state = scaler.state_dict()  # an enabled scaler's: one read, at the start or after a resume
        self.scale = float(state["scale"])
        self.tracker = int(state["_growth_tracker"])
        self.growth = float(state["growth_factor"])
        self.backoff = float(state["backoff_factor"])
        self.interval = int(state["growth_interval"])

    @staticmethod
    def _float32(x: float) -> float:
        return struct.unpack("f", struct.pack("f", x))[0] if math.isfinite(x) and abs(x) < 3.4e38 else math.inf

    def update(self, skipped: bool) -> float:
        """The scale after a step, rounded as the scaler's float32 tensor is (its factors are doubles)."""
        if skipped:
            self.scale = self._float32(self.scale * self.backoff)
            self.tracker = 0
        else:
            self.tracker += 1
            if self.tracker == self.interval:
                grown = self._float32(self.scale * self.growth)
                self.scale = grown if math.isfinite(grown) else self.scale
                self.tracker = 0
        return self.scale


class StepLedger:
    """One run's optimizer steps as the host knows them: taken or skipped, the loss scale and its history, inf/NaN
    losses in a row, the learning-rate schedule, the epoch's loss sum and the gradient norms, all without a sync
    beyond GradScaler's own. ``on_stop(why)`` is called (and must raise) when amp.max_consecutive_nonfinite losses
    in a row were inf/NaN."""

    # what a checkpoint keeps (with the schedule's state and the epoch's loss sum)
    SCALARS = ("skipped", "last_scale", "scale_history", "seen", "nonfinite_steps", "consecutive_nonfinite",
               "grad_norms")

    def __init__(self, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, total_steps: int,
                 device: torch.device, world: distributed.World, max_nonfinite: int, log_norms: bool,
                 on_stop: Callable[[str], None]):
        self.scaler, self.world, self.max_nonfinite = scaler, world, max_nonfinite
        # held weakly: the trainer holds this ledger, and a cycle would keep the trainer (its data feeds and their
        # DataLoader workers) alive until a garbage collection at some later moment, which then waits on them
        self._on_stop = weakref.WeakMethod(on_stop) if inspect.ismethod(on_stop) else lambda: on_stop
        self.device = device
        self.sched = schedule(opt, total_steps, scaler)
        self.deferred = skips_on_device(opt, scaler)  # a fused optimizer under fp16: skips settled at the syncs
        self.taken = TakenSteps(opt)  # the steps GradScaler let through, seen without a sync
        self.host_scale = HostScale(scaler) if scaler.is_enabled() else None
        self.last_scale = self.host_scale.scale if self.host_scale else None
        self.scale_history = [{"step": 0, "scale": self.last_scale, "skipped": False}] if self.last_scale else []
        self.skipped = self.nonfinite_steps = self.consecutive_nonfinite = 0
        self.pending: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (found_inf, loss, images) per step
        # the gradient norm before clipping, per optimizer step: kept on the device, read at the loop's syncs
        self.norms: list[torch.Tensor] | None = [] if log_norms else None
        self.grad_norms: list[dict] = []
        self.step = 0  # optimizer steps recorded
        self.new_epoch()

    def new_epoch(self) -> None:
        self._loss_sum, self.seen = torch.zeros((), device=self.device), 0  # the epoch's, summed on the device
        self._losses: list[torch.Tensor] = []  # steps' mean losses (on the device) not yet in the sum
        self._images: list[int] = []  # and their images

    @property
    def loss_sum(self) -> torch.Tensor:
        """The epoch's loss summed over its images, on the device (read at the loop's syncs)."""
        self._sum_pending()
        return self._loss_sum

    @loss_sum.setter
    def loss_sum(self, value: torch.Tensor) -> None:
        self._loss_sum, self._losses, self._images = value, [], []

    def _sum_pending(self) -> None:
        """Add the steps' losses not yet in the sum, in one go: a few ops at a sync, not one op a step."""
        if self._losses:
            losses = torch.stack(self._losses)
            if self.deferred:  # an inf/NaN loss stays out of the sum; settle uncounts its images
                losses = torch.where(torch.isfinite(losses), losses, 0.0)
            if len(set(self._images)) == 1:  # every step of an epoch has the same images (the last is dropped)
                self._loss_sum.add_(losses.sum(), alpha=self._images[0])
            else:
                self._loss_sum.add_((losses * losses.new_tensor(self._images)).sum())
            self._losses, self._images = [], []

    def mark(self) -> int:
        """Before a step: the count of steps taken so far."""
        return self.taken.count

    def record(self, mark: int, loss: torch.Tensor, n: int) -> bool | None:
        """After a step on ``n`` images whose mean loss is ``loss`` (on the device, ``step.train_step``'s, already
        detached: kept as it is): True if the scaler skipped it (an inf/NaN gradient), None where only the device
        knows yet (a fused optimizer under fp16: ``settle`` accounts for it at the next sync)."""
        self.step += 1
        if self.deferred:
            found_inf = self.taken.found_inf
            self.sched.step(found_inf)  # on the device: the schedule advances only if the step was taken
            self._losses.append(loss)  # summed at the next sync, an inf/NaN one as 0 (settle uncounts it)
            self._images.append(n)
            self.seen += n
            self.pending.append((found_inf, loss, n))
            return None
        skipped = self.taken.count == mark  # GradScaler's one sync decided it; no second one here
        nonfinite_loss = False
        if self.host_scale is not None and skipped:
            # Only a skipped step can carry an inf/NaN loss; asking costs a sync on those steps alone. Every
            # rank skips the same steps (the all-reduced gradients are the same), and all count a loss that
            # went inf/NaN on any rank, so their counters and the decision to stop stay the same.
            nonfinite_loss = self.world.reduce([float(not torch.isfinite(loss))], "max")[0] > 0
        if not skipped:
            self.sched.step()  # a skipped step did not change the weights, so neither does the LR schedule
        if not nonfinite_loss:
            self._losses.append(loss)  # summed at the next sync (``loss_sum``): no op per step
            self._images.append(n)
            self.seen += n
        self._account(self.step, skipped, nonfinite_loss)
        return skipped

    def _account(self, step_number: int, skipped: bool, nonfinite_loss: bool) -> None:
        """The host's counters after optimizer step ``step_number``."""
        if self.host_scale is not None:
            scale = self.host_scale.update(skipped)  # the scale GradScaler now holds, without reading it
            if scale != self.last_scale:
                self.scale_history.append({"step": step_number, "scale": scale, "skipped": skipped})
            self.last_scale = scale
        if skipped:
            self.skipped += 1
        if nonfinite_loss:
            self.nonfinite_steps += 1
            self.consecutive_nonfinite += 1
            if self.consecutive_nonfinite >= self.max_nonfinite:
                self._on_stop()(f"{self.consecutive_nonfinite} steps in a row had an inf/NaN loss "
                                f"(amp.max_consecutive_nonfinite = {self.max_nonfinite})")
        else:
            self.consecutive_nonfinite = 0

    def settle(self) -> None:
        """At a sync the loop makes anyway: read the gradient norms kept on the device, and account for the steps
        whose skip only the device knew (a fused optimizer under fp16): one read of their found-inf flags and loss
        checks. The ranks agree on the skips (the gradients are all-reduced) and take the largest of their
        inf/NaN-loss flags, as the host path does."""
        if self.norms:
            first = self.step - len(self.norms) + 1
            values = torch.stack([n.reshape(()).float() for n in self.norms]).tolist()
            self.grad_norms += [{"step": first + i, "grad_norm": v} for i, v in enumerate(values)]
            self.norms.clear()
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        flags = torch.stack([torch.stack([f.reshape(()).float(), (~torch.isfinite(loss)).float()])
                             for f, loss, _ in pending]).tolist()
        nonfinite = self.world.reduce([bad for _, bad in flags], "max")
        first = self.step - len(pending) + 1
        for i, ((skipped, _), bad, (_, _, n)) in enumerate(zip(flags, nonfinite, pending, strict=True)):
            if bad > 0:
                self.seen -= n  # its loss was left out of the sum on the device
            self._account(first + i, skipped > 0, bad > 0)

    def check_scale(self, variant: str) -> None:
        """Once an epoch (a sync the epoch's end makes anyway): the host's mirror of the loss scale is the
        GradScaler's own, or the skip detection is wrong and the counters cannot be trusted."""
        from ampbench.errors import AmpbenchError

        if self.host_scale is not None and self.host_scale.scale != self.scaler.get_scale():
            raise AmpbenchError(f"[{variant}] the loss scale followed on the host ({self.host_scale.scale:g}) differs "
                                f"from the GradScaler's ({self.scaler.get_scale():g}): skipped steps were miscounted")

    def agreed(self) -> tuple:
        """What every rank's ledger must hold alike (``distributed.check_agree``)."""
        return (self.last_scale, self.skipped, self.nonfinite_steps, len(self.scale_history),
                self.scale_history[-1] if self.scale_history else None)

    def state_dict(self) -> dict:
        """The ledger's part of a checkpoint: its counters, the schedule's state, and the epoch's loss sum over the
        ranks (every rank calls it)."""
        self.settle()
        state = {k: getattr(self, k) for k in self.SCALARS}
        if self.world.size > 1:  # the ranks' losses are summed here; rank 0 alone resumes with them
            self._sum_pending()
        # in one process the steps not yet summed are kept as they are, so that a resumed run sums the same losses
        # in the same groups as an uninterrupted one, to the last bit
        unsummed = list(zip(torch.stack(self._losses).tolist(), self._images, strict=True)) if self._losses else []
        loss_sum, seen = self.world.reduce([self._loss_sum.item(), self.seen])
        return {**state, "seen": int(seen), "loss_sum": loss_sum, "unsummed_losses": unsummed,
                "sched": self.sched.state_dict()}

    def load_state_dict(self, state: dict, step: int) -> None:
        """After the optimizer's and the scaler's own loads; ``step``: the optimizer steps the run had made."""
        for k in self.SCALARS:
            setattr(self, k, state[k])
        self.step = step
        if self.host_scale is not None:
            self.host_scale = HostScale(self.scaler)  # the resumed scale and growth tracker
        self.sched.load_state_dict(state["sched"])
        self.loss_sum = torch.tensor(state["loss_sum"], device=self.device)
        for loss, n in state.get("unsummed_losses", []):
            self._losses.append(torch.tensor(loss, device=self.device))
            self._images.append(n)
        if not self.world.main:  # the sums over the ranks resume on rank 0 alone
            self.loss_sum = torch.zeros((), device=self.device)
            self.seen = 0
