"""The learning-rate schedule: ``lr_lambda``'s linear warm-up over the first 5% of optimizer steps, then cosine
decay to zero, written once and followed from a table of its values, on the host (``HostSchedule``) or, where only
the device knows which steps were taken (a fused optimizer under fp16), on the device (``DeviceSchedule``).
``schedule`` picks; both advance only on steps taken.
"""

from __future__ import annotations

import math

import torch


def lr_lambda(total_steps: int):
    """Linear warm-up over the first 5% of optimizer steps, then cosine decay to zero."""
    warm = max(1, round(0.05 * total_steps))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def skips_on_device(opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> bool:
    """Whether an enabled GradScaler steps ``opt`` with its skip decided on the device: a fused optimizer's
    ``step()`` always runs and leaves the weights (and its step count) unchanged where a gradient was inf/NaN,
    with no host sync, so the host learns of a skip only at its next sync."""
    return scaler.is_enabled() and bool(opt.defaults.get("fused"))


def schedule(opt: torch.optim.Optimizer, total_steps: int, scaler: torch.amp.GradScaler | None = None):
    """The learning-rate schedule over ``total_steps`` optimizer steps, advanced only on steps taken: on the host
    (``HostSchedule``, stepped when a step was taken), or on the device where only the device knows
    (``DeviceSchedule``, stepped every step with the scaler's found-inf flag)."""
    if scaler is not None and skips_on_device(opt, scaler):
        return DeviceSchedule(opt, total_steps)
    return HostSchedule(opt, total_steps)


class HostSchedule:
    """``lr_lambda``'s schedule on the host: after each step taken, each param group's ``lr`` is its base times
    ``lr_lambda(steps taken)``, read from a table. The rates ``LambdaLR(opt, lr_lambda(total_steps))`` gives,
    without its per-step machinery (the lambda called per group, its checks and lists): a table read and a
    dict write, since every microsecond the host spends per step is step time on a launch-bound GPU."""

    def __init__(self, opt: torch.optim.Optimizer, total_steps: int):
        self.opt = opt
        f = lr_lambda(total_steps)
        self.factors = [f(s) for s in range(total_steps + 1)]  # past the end: the last (0, as lr_lambda gives)
        self.base_lrs = [float(g["lr"]) for g in opt.param_groups]
        self.taken = 0
        self._write()

    def _write(self) -> None:
        factor = self.factors[min(self.taken, len(self.factors) - 1)]
        for g, base in zip(self.opt.param_groups, self.base_lrs, strict=True):
            g["lr"] = base * factor

    def step(self) -> None:
        self.taken += 1
        self._write()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.opt.param_groups]

    def state_dict(self) -> dict:
        return {"taken": self.taken}

    def load_state_dict(self, state: dict) -> None:
        """After the optimizer's own load; a checkpoint of LambdaLR's (``last_epoch``) counts the same steps."""
        self.taken = int(state["taken"] if "taken" in state else state["last_epoch"])
        self._write()


class DeviceSchedule:
    """``lr_lambda``'s schedule, followed on the device from the steps really taken.

    A fused optimizer stepped by an enabled GradScaler skips an overflowing step on the device; a host schedule
    would run one step ahead from there until the next sync. Here each param group's ``lr`` is a 0-d float32
    tensor on the device (fused kernels read it there), and ``step(found_inf)`` adds ``found_inf == 0`` to the
    count of steps taken and gathers the group's rate for that count into it, from a table of ``base_lr *
    lr_lambda(steps)`` made once: four small kernels a step (the comparison, the add, a clamp at the table's end,
    the gather), each a launch on the host's time, and no sync. Exact whatever the sync points, so a resumed run
    follows the same schedule as an uninterrupted one.
    """

    def __init__(self, opt: torch.optim.Optimizer, total_steps: int):
        self.opt = opt
        device = next(p.device for g in opt.param_groups for p in g["params"])
        f = lr_lambda(total_steps)
        factors = torch.tensor([f(s) for s in range(total_steps + 1)], dtype=torch.float64)
        self.base_lrs = [float(g["lr"]) for g in opt.param_groups]
        # each group's rates, rounded to float32 once as the rate a step reads (the product taken in float64)
        self.tables = [(factors * base).to(device=device, dtype=torch.float32) for base in self.base_lrs]
        self.last = total_steps  # past the end: the table's last rate (0, as lr_lambda gives)
        self.taken = torch.zeros(1, dtype=torch.long, device=device)  # shaped as index_select's index
        for g, base in zip(opt.param_groups, self.base_lrs, strict=True):
            g["lr"] = torch.tensor(base, dtype=torch.float32, device=device)
        self._hold_rates()

    def _hold_rates(self) -> None:
        """Each group's lr tensor (which the fused kernels read) as the 1-element view a gather writes into, made
        once, not per step; then its rate."""
        self.rates = [g["lr"].view(1) for g in self.opt.param_groups]
        self._write()

    def _write(self) -> None:
        # index_select with out=: the gather writes each group's lr tensor itself, one op (table[index] would make
        # a tensor to copy in); the index stays on the device, no sync
        index = self.taken.clamp(max=self.last)
        for table, rate in zip(self.tables, self.rates, strict=True):
            torch.index_select(table, 0, index, out=rate)

    def step(self, found_inf: torch.Tensor) -> None:
        self.taken += found_inf == 0  # a step taken where the scaler found no inf/NaN
        self._write()

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.opt.param_groups]  # a sync: read where the loop syncs anyway

    def state_dict(self) -> dict:
        return {"taken": int(self.taken.item())}

    def load_state_dict(self, state: dict) -> None:
        """After the optimizer's own load (which brings back its groups' saved ``lr``): fresh device tensors."""
        self.taken.fill_(int(state["taken"] if "taken" in state else state["last_epoch"]))  # as HostSchedule's
        for g in self.opt.param_groups:
            g["lr"] = torch.zeros((), dtype=torch.float32, device=self.taken.device)
        self._hold_rates()
