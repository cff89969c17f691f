"""Data-parallel training under torchrun: the process group, DDP, gradient communication, what the ranks agree on.

    torchrun --standalone --nproc-per-node 2 stages/train.py --plan reports/plans/amp.json ...

torchrun starts the processes and sets RANK, WORLD_SIZE and LOCAL_RANK; with a
world of one (or a plan with ``ddp: false``) nothing here starts a process group,
and training is the single-process loop. With more, every rank builds the same
model from the same seed, ``DistributedDataParallel`` all-reduces the gradients
(as fp32, or compressed to fp16/bf16 by PyTorch's own communication hooks), each
rank trains on its own slice of every global batch, and rank 0 alone writes.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ampbench.errors import AmpbenchError


@dataclass(frozen=True)
class World:
    """This process's place among the training processes."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str = ""

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """True when gradients are all-reduced across processes."""
        return self.size > 1

    def device(self, kind: str) -> torch.device:
        """The device this rank trains on: its own GPU (LOCAL_RANK) on CUDA."""
        return torch.device("cuda", self.local_rank) if kind == "cuda" else torch.device("cpu")

    def reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """``values`` summed (or maxed) over the ranks; the values themselves in a world of one."""
        if not self.active:
            return list(values)
        dev = self.device("cuda") if self.backend == "nccl" else torch.device("cpu")  # nccl reduces on the GPU
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` in a world of one."""
        if not self.active:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out


SINGLE = World()


def launched() -> World:
    """The world torchrun launched this process into (RANK, WORLD_SIZE, LOCAL_RANK), before any process group."""
    env = os.environ
    return World(rank=int(env.get("RANK", 0)), size=int(env.get("WORLD_SIZE", 1)),
                 local_rank=int(env.get("LOCAL_RANK", 0)))


def init(backend: str, device_kind: str) -> World:
    """Join the process group torchrun set up (nothing to join in a world of one); this rank's ``World``."""
    w = launched()
    if w.size == 1:
        return SINGLE
    if backend == "nccl" and device_kind != "cuda":
        raise AmpbenchError("distributed.backend = 'nccl' needs CUDA GPUs; use backend: gloo (or auto) on a CPU")
    if device_kind == "cuda":
        if torch.cuda.device_count() <= w.local_rank:
            raise AmpbenchError(f"rank {w.rank} has LOCAL_RANK {w.local_rank} but this machine has "
                                f"{torch.cuda.device_count()} GPU(s); start at most one process per GPU "
                                "(torchrun --nproc-per-node)")
        torch.cuda.set_device(w.local_rank)
    if not dist.is_initialized():
        kw = {"device_id": w.device(device_kind)} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, **kw)
    return World(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=w.local_rank, backend=backend)


def torchrun(nproc: int, argv: list[str]) -> None:
    """Run ``argv`` (a script and its arguments) in ``nproc`` processes under torchrun's elastic agent, in this
    process (Ctrl-C and kills reach the agent as they reach torchrun). A rank that stops with ampbench's message
    (``errors.run_cli``) ends the stage with that message said again, last, and that rank's exit code, instead of
    torchrun's ChildFailedError traceback; a rank that dies without one is named with its exit code; a signal to the
    agent (Ctrl-C) ends it with one line and 128 + the signal's number, not the agent's SignalException traceback."""
    import tempfile
    from pathlib import Path

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from ampbench.errors import RANK_ERRORS_ENV

    with tempfile.TemporaryDirectory(prefix="ampbench-ranks-") as said:
        os.environ[RANK_ERRORS_ENV] = said  # the ranks inherit it
        try:
            run(get_args_parser().parse_args(["--standalone", "--nproc-per-node", str(nproc), *argv]))
        except ChildFailedError as err:
            # each: "<its exit code>\n<its message>", written before it exited (the agent may have stopped it after)
            said_by = {int(f.name.removeprefix("rank")): f.read_text().partition("\n")
                       for f in Path(said).glob("rank*")}
            # the lowest rank that said why it stopped, with the exit code it said; else the first to fail
            rank, failure = next(((r, f) for r, f in sorted(err.failures.items()) if r in said_by),
                                 err.get_first_failure())
            if rank in said_by:
                code, _, text = said_by[rank]
                print(f"error: {text}", file=sys.stderr)
                sys.exit(int(code) if code.isdigit() and int(code) > 0 else 1)
            print(f"error: training process {rank} ended with exit code {failure.exitcode} and no message of its own",
                  file=sys.stderr)
            sys.exit(failure.exitcode if isinstance(failure.exitcode, int) and failure.exitcode > 0 else 1)
        except SignalException as err:  # Ctrl-C or a kill to the agent: it passed the signal on and closed the ranks
            import signal
            # the agent's handlers stay installed and raise again on a second signal: with the ranks closed there is
            # nothing left to stop, and one arriving while the interpreter exits would print a finalizer's traceback
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            name = signal.Signals(err.sigval).name
            print(f"stopped by {name}{' (Ctrl-C)' if name == 'SIGINT' else ''}: the next `dvc repro` resumes from the "
                  f"last checkpoint saved", file=sys.stderr)
            sys.exit(128 + int(err.sigval))


def exit_with_launcher(poll_s: float = 0.5) -> None:
    """Under torchrun, end this process when torchrun ends.

    torchrun starts each worker in a session of its own, so a SIGKILL to torchrun (or to its process group, or
    to the whole `dvc repro`) would leave the workers training, and writing, on their own. A daemon thread
    watches the parent process and stops this one the moment it is gone.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                sys.stderr.write(f"rank {os.environ.get('RANK', '?')}: torchrun has gone; stopping\n")
                sys.stderr.flush()
                os._exit(137)

    threading.Thread(target=watch, name="ampbench-torchrun-watch", daemon=True).start()


class StopVote:
    """Whether some rank wants to stop (Ctrl-C, SIGTERM), agreed by every rank within two votes of it and with no
    device sync: each vote starts an all-reduce (max) of this rank's wish on a gloo group of its own, off the
    training stream, and reads the one the vote before started (done by then: DDP keeps the ranks in step). Every
    rank votes after the same steps and reads the same answer, so all stop there; a scheduler's grace (``docker
    stop``: 10 s) is spent on two votes, not on the wait for the next loss sync (25 steps).

    A vote costs the host about a tenth of a millisecond (gloo's round trip on the main thread), so it is not cast
    every step of a short one: ``every(step_s)`` gives the steps between votes for about ``INTERVAL_S`` of training
    between them, from a step time all ranks agree on."""

    INTERVAL_S = 0.05  # training time between votes: a stop lands within about twice this
    MAX_EVERY = 12  # and within 24 steps, under the loss sync's 25

    @classmethod
    def every(cls, step_s: float) -> int:
        """Steps between votes for steps of ``step_s`` seconds (the same on every rank: a reduced figure)."""
        return max(1, min(cls.MAX_EVERY, int(cls.INTERVAL_S / step_s))) if step_s > 0 else 1

    _group = None  # one per process, made by every rank at the same point (new_group is collective)

    def __init__(self, world: World):
        self.world = world
        if self.world.active and StopVote._group is None:
            StopVote._group = dist.new_group(backend="gloo")
        self._pending = None

    def __call__(self, wish: bool) -> bool:
        """After a voting step: True once some rank's wish, sent a vote ago, reached every rank."""
        if not self.world.active:
            return wish
        agreed = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = bool(flag.item())
        flag = torch.tensor([int(wish)], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=StopVote._group, async_op=True), flag)
        return agreed

    def close(self) -> None:
        """Wait for the last vote sent (every rank sent it), so none is in flight when the process group goes."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


def shutdown() -> None:
    StopVote._group = None
    if dist.is_initialized():
        dist.destroy_process_group()


def comm_hook(grad_comm: str):
    """PyTorch's DDP communication hook for ``grad_comm``: None for fp32 (DDP's built-in all-reduce)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return {"none": None, "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook}[grad_comm]


def wrap(model: torch.nn.Module, world: World, grad_comm: str = "none",
         find_unused_parameters: bool = False) -> torch.nn.Module:
    """``model`` in DistributedDataParallel with ``grad_comm``'s hook; ``model`` itself in a world of one.

    DDP broadcasts rank 0's weights and buffers when it is built, so every rank starts from the same model.
    ``find_unused_parameters`` is DDP's own: needed when the loss does not use every parameter.
    """
    if not world.active:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP
    dev = next(model.parameters()).device
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None,
              find_unused_parameters=find_unused_parameters)
    hook = comm_hook(grad_comm)
    if hook is not None:
        ddp.register_comm_hook(state=None, hook=hook)
    return ddp


def step_model(model: torch.nn.Module, world: World, plan) -> torch.nn.Module:
    """What a training step calls (``plan``: a RunPlan): ``model``, compiled when train.compile asks, inside DDP
    under several processes.

    The compiled module goes inside DDP, as PyTorch advises: ``torch.compile`` of the DDP wrapper breaks its graph
    at DDP's forward (a generator context manager) and, on torch 2.14, runs the model eagerly.
    """
    inner = torch.compile(model) if plan.train.compile else model
    return wrap(inner, world, plan.grad_comm, plan.find_unused_parameters)


def sync_context(model: torch.nn.Module, sync: bool):
    """When ``sync`` is false, gradients stay local: ``model.no_sync()`` on a DDP model, no reduce-scatter on an
    FSDP one (``fsdp.no_gradient_sync``); else nothing."""
    if sync:
        return nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):
        from ampbench.train import fsdp
        return fsdp.no_gradient_sync(model)
    return model.no_sync() if hasattr(model, "no_sync") else nullcontext()


def broadcast_buffers(model: torch.nn.Module, world: World) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank, e.g. before a sharded evaluation."""
    if world.active:
        for b in model.buffers():
            dist.broadcast(b, src=0)


def check_agree(world: World, what: str, value) -> None:
    """Raise unless every rank holds the same ``value`` (e.g. the GradScaler's scale and skipped steps)."""
    values = world.gather(value)
    if any(v != values[0] for v in values[1:]):
        raise AmpbenchError(f"the ranks disagree on {what}: " + ", ".join(f"rank {i}: {v}" for i, v in
                                                                          enumerate(values)))
