"""Data-parallel training on the CPU: 2 gloo processes with one thread each, as torchrun would start them.

DDP's gradients over two ranks equal one process's full-batch gradients, with and without accumulation, and
accumulation all-reduces once per optimizer step (no_sync); the shards cover each batch once. The helpers here start
the ranks for the DDP tests of other files (the trainer's: test_ddp_trainer).
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ampbench import config, data, models, runplan
from ampbench.data.batches import DeviceBatches
from ampbench.train import distributed, step
from ampbench.train.engine import Trainer
from ampbench.train.policy import PrecisionPolicy

WORLD = 2
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, port: int) -> distributed.World:
    """What torchrun gives a worker: its rank and the rendezvous address in the environment."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    return distributed.init("gloo", "cpu")


# The ranks are forked from one server process that has imported torch and these tests once (multiprocessing's
# forkserver), not started as new interpreters that each import torch again: the same processes torchrun's
# workers are as far as gloo and the trainer can tell, at a fraction of the start-up. The server is single-threaded
# (no thread of pytest's is forked), and each rank still sets its own environment and threads in _join.
mp.get_context("forkserver").set_forkserver_preload(["torch", "tests.test_distributed"])


def _spawn(fn, *args) -> None:
    mp.start_processes(fn, args=(_free_port(), *args), nprocs=WORLD, join=True, start_method="forkserver")


def _images(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (n, 3, 16, 16), dtype=torch.uint8, generator=g), torch.randint(0, 10, (n,),
                                                                                                generator=g)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = models.build(config.ModelConfig(arch="small_cnn", channels_last=False), num_classes=10, image_size=16,
                         device=torch.device("cpu"))
    return model.eval()  # BatchNorm on its running statistics: each image's gradient is its own


def _gradients(model, batches: DeviceBatches, micro: int, world_size: int, ddp_model=None) -> list[torch.Tensor]:
    x, y = next(batches.epoch(0))
    weight = len(y) * world_size / batches.global_count(0) if world_size > 1 else 1.0
    policy = PrecisionPolicy("fp32", "cpu", None)
    step.accumulate_gradients(ddp_model or model, x, y, micro, policy, policy.scaler(), weight)
    return [p.grad.detach().clone() for p in model.parameters()]


def _grad_worker(rank: int, port: int, out: str, batch: int, accum: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    world = _join(rank, port)
    calls = [0]

    def counting_allreduce(state, bucket):  # PyTorch's own all-reduce, counted
        calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    model = _model()
    ddp = distributed.wrap(model, world)
    ddp.register_comm_hook(None, counting_allreduce)
    batches = DeviceBatches(*_images(), batch, MEAN, STD, augment=True, shuffle=True, channels_last=False, seed=3,
                            shard=(world.rank, world.size))
    micro = math.ceil(math.ceil(batch / WORLD) / accum)  # the largest slice over accum: the same on both ranks
    grads = _gradients(model, batches, micro, world.size, ddp)
    engine_calls = calls[0]
    # Without no_sync: every micro-batch a step of its own, so every one of them all-reduces
    model.zero_grad(set_to_none=True)
    calls[0] = 0
    x, y = next(batches.epoch(0))
    policy = PrecisionPolicy("fp32", "cpu", None)
    for xs, ys in zip(x.split(micro), y.split(micro), strict=True):
        step.accumulate_gradients(ddp, xs, ys, len(ys), policy, policy.scaler())
    torch.save({"grads": grads, "calls": engine_calls, "calls_without_no_sync": calls[0],
                "local": len(y), "micro_batches": len(x.split(micro))}, Path(out) / f"rank{rank}.pt")
    distributed.shutdown()


@pytest.mark.parametrize("batch,accum", [(32, 1), (32, 4), (31, 2)])  # 31: slices of 16 and 15 images
def test_ddp_gradients_equal_one_process_full_batch(tmp_path, batch, accum):
    _spawn(_grad_worker, str(tmp_path), batch, accum)
    model = _model()
    whole = DeviceBatches(*_images(), batch, MEAN, STD, augment=True, shuffle=True, channels_last=False, seed=3)
    ref = _gradients(model, whole, batch, 1)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert sum(r["local"] for r in ranks) == batch  # the two slices make up the global batch
    scale = max(g.abs().max() for g in ref)
    for r in ranks:
        worst = max((g - gr).abs().max() for g, gr in zip(r["grads"], ref, strict=True))
        assert worst / scale < 1e-5, f"DDP gradient differs from the full batch's by {worst / scale:.2e}"
    buckets = ranks[0]["calls"]
    assert buckets >= 1 and all(r["calls"] == buckets for r in ranks)  # one all-reduce per bucket per step
    assert all(r["micro_batches"] == accum for r in ranks)
    assert all(r["calls_without_no_sync"] == buckets * accum for r in ranks)
    if accum > 1:
        assert ranks[0]["calls_without_no_sync"] > buckets  # no_sync really skipped the intermediate all-reduces


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 10))


def _clipped_step(model, batches: DeviceBatches, micro: int, step_model=None) -> tuple[list, float]:
    """One clipped train_step (SGD, lr 1, no momentum: the update is minus the clipped gradient)."""
    x, y = next(batches.epoch(0))
    policy = PrecisionPolicy("fp32", "cpu", None)
    before = [p.detach().clone() for p in model.parameters()]
    norms: list = []
    step.train_step(step_model or model, torch.optim.SGD(model.parameters(), lr=1.0), policy.scaler(), policy, x, y,
                    micro, clip=0.05, norms=norms)
    return [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)], float(norms[0])


def _clip_worker(rank: int, port: int, out: str) -> None:
    world = _join(rank, port)
    model = _mlp()
    batches = DeviceBatches(*_images(), 32, MEAN, STD, augment=False, shuffle=True, channels_last=False, seed=3,
                            shard=(world.rank, world.size))
    update, norm = _clipped_step(model, batches, 8, distributed.wrap(model, world))  # 2 micro-batches per rank
    torch.save({"update": update, "norm": norm}, Path(out) / f"rank{rank}.pt")
    distributed.shutdown()


def test_ddp_with_accumulation_clips_the_full_batch_gradient(tmp_path):
    """Clipping after the last micro-batch's all-reduce: both ranks clip the global batch's gradient, by the
    global norm, as one process does with the full batch."""
    _spawn(_clip_worker, str(tmp_path))
    whole = DeviceBatches(*_images(), 32, MEAN, STD, augment=False, shuffle=True, channels_last=False, seed=3)
    ref, ref_norm = _clipped_step(_mlp(), whole, 32)
    assert ref_norm > 0.1  # clipping is active
    for r in range(WORLD):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["norm"] == pytest.approx(ref_norm, rel=1e-5)
        worst = max(((u - v).abs().max() / v.abs().max()).item() for u, v in zip(got["update"], ref, strict=True))
        assert worst < 1e-4


def test_shards_cover_each_global_batch_once():
    x, y = _images(50)

    def batches(shuffle: bool, shard=(0, 1)):
        return list(DeviceBatches(x, y, 16, MEAN, STD, augment=True, shuffle=shuffle, channels_last=False,
                                  shard=shard).epoch(2))

    for shuffle in (True, False):
        whole = batches(shuffle)
        parts = [batches(shuffle, (r, 3)) for r in range(3)]
        assert [len(b[1]) for b in whole] == [16, 16, 16, 2]
        # training drops a last batch of 2 < 3 ranks (a rank without images would stall DDP); evaluation keeps it
        assert [len(b[1]) for b in parts[0]] == ([6, 6, 6] if shuffle else [6, 6, 6, 1])
        assert [len(b[1]) for b in parts[2]] == ([5, 5, 5] if shuffle else [5, 5, 5, 0])
        for i in range(len(parts[0])):  # the same images, labels and augmentation as one process's batch
            assert torch.equal(torch.cat([parts[r][i][1] for r in range(3)]), whole[i][1])
            assert torch.equal(torch.cat([parts[r][i][0] for r in range(3)]), whole[i][0])


def _ranks(tmp_path: Path, worker) -> list[dict]:
    """A small synthetic set in ``tmp_path``, ``worker`` on WORLD gloo ranks, and what each rank wrote."""
    data.prepare(config.DataConfig(source="synthetic", train_size=128, test_size=32), 0, tmp_path / "prepared",
                 tmp_path / "raw")
    _spawn(worker, str(tmp_path))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _trainer(world: distributed.World, folder: str, variant: str, train=(), dist_params=(), model=()) -> Trainer:
    """A Trainer of the small CNN (or ``model``'s settings) on ``_ranks``'s data, batch 32, over ``world``."""
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "small_cnn", **dict(model)},
                            "mlflow": {"enabled": False},
                            "train": {"epochs": 1, "batch_size": 32, "warmup_steps": 0, **dict(train)},
                            "distributed": {"nproc_per_node": WORLD, **dict(dist_params)}})
    return Trainer(runplan.make_plan(cfg, variant, "cpu"), data.load_prepared(Path(folder) / "prepared", "cpu"),
                   progress=False, world=world)


def test_short_steps_vote_on_stopping_every_few_steps_long_ones_every_step():
    """A vote costs the host about 0.1 ms (gloo's round trip): about every 50 ms of training for short steps, never
    more than 12 steps apart (a stop within 24, before the loss sync at 25), every step for steps of 50 ms or
    more; every step until the first loss sync has timed them."""
    from ampbench.train.distributed import StopVote
    assert StopVote.every(0.001) == 12 and StopVote.every(0.01) == 5 and StopVote.every(0.02) == 2
    assert StopVote.every(0.05) == 1 and StopVote.every(2.0) == 1 and StopVote.every(0.0) == 1
