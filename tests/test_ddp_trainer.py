"""The trainer under data parallelism on the CPU (2 gloo ranks, test_distributed's helpers): an inf on one rank makes
every rank skip the step, find_unused_parameters, fp8, torch.compile against eager DDP, ranks that disagree."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ampbench import config, data, runplan
from ampbench.train import distributed
from ampbench.train.engine import Trainer
from tests.test_distributed import WORLD, _join, _ranks, _spawn, _trainer


def _inf_worker(rank: int, port: int, folder: str) -> None:
    trainer = _trainer(_join(rank, port), folder, "amp")
    batches = trainer.train_batches.epoch(0)
    for i in range(3):
        x, y = next(batches)
        if i == 1 and rank == 1:
            x = x.clone()
            x[0] = float("inf")  # only this rank's slice of the batch goes non-finite
        trainer.step_in_epoch = trainer.global_step = i  # what run_epoch keeps
        trainer.optimizer_step(x, y)
    book = trainer.ledger
    out = {"skipped": book.skipped, "scale": book.last_scale, "history": book.scale_history,
           "nonfinite": book.nonfinite_steps, "weights": sum(float(p.detach().double().sum()) for p in
                                                             trainer.model.parameters())}
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(out))
    distributed.shutdown()


def test_an_inf_on_one_rank_makes_every_rank_skip_the_step(tmp_path):
    ranks = _ranks(tmp_path, _inf_worker)
    assert ranks[0] == ranks[1]  # the same skipped steps, scale history, counters and weights
    assert ranks[0]["skipped"] == 1 and ranks[0]["nonfinite"] == 1
    assert ranks[0]["scale"] == config.AmpConfig().init_scale / 2
    assert ranks[0]["history"][-1] == {"step": 2, "scale": ranks[0]["scale"], "skipped": True}


class _Spare(torch.nn.Module):
    """A model whose loss never uses ``spare``: DDP must be told (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.head, self.spare = torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(x)


def _unused_worker(rank: int, port: int, folder: str) -> None:
    world = _join(rank, port)
    trainer = _trainer(world, folder, "fp32", dist_params={"find_unused_parameters": True})
    out = {"trainer": trainer.step_model.find_unused_parameters}
    for flag in (True, False):  # the failing one last: it leaves its DDP mid-reduction
        torch.manual_seed(0)
        model = distributed.wrap(_Spare(), world, find_unused_parameters=flag)
        try:
            for i in range(3):
                model(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + i))).sum().backward()
            out[str(flag)] = [float(p.grad.sum()) for p in model.module.head.parameters()]
        except RuntimeError as err:
            out[str(flag)] = "find_unused_parameters" in str(err)
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(out))
    distributed.shutdown()


def test_find_unused_parameters_lets_ddp_train_a_model_with_a_parameter_the_loss_does_not_use(tmp_path):
    ranks = _ranks(tmp_path, _unused_worker)
    assert ranks[0]["trainer"] is True  # the plan's flag reaches the Trainer's DDP
    assert ranks[0]["True"] == ranks[1]["True"] and len(ranks[0]["True"]) == 2  # trained, gradients all-reduced
    assert ranks[0]["False"] is True and ranks[1]["False"] is True  # without it DDP stops at the second step


def _fp8_worker(rank: int, port: int, folder: str) -> None:
    world = _join(rank, port)
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "vit_tiny", "input_size": 16},
                            "mlflow": {"enabled": False}, "train": {"epochs": 1, "batch_size": 16, "warmup_steps": 0},
                            "variants": {"fp8": {"precision": "fp8", "recipe": "rowwise"}},
                            "distributed": {"nproc_per_node": WORLD}})
    trainer = Trainer(runplan.make_plan(cfg, "fp8", "cpu"), data.load_prepared(Path(folder) / "prepared", "cpu"),
                      progress=False, world=world)
    batches = trainer.train_batches.epoch(0)
    for i in range(2):
        trainer.step_in_epoch = trainer.global_step = i
        trainer.optimizer_step(*next(batches))
    out = {"float8": sum(type(m).__name__ == "Float8Linear" for m in trainer.model.modules()),
           "weights": [float(p.detach().double().sum()) for p in trainer.model.parameters()],
           "nonfinite": trainer.ledger.nonfinite_steps}
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(out))
    distributed.shutdown()


def test_fp8_trains_under_ddp_with_the_ranks_in_step(tmp_path):
    """torchao's float8 layers inside DDP (gloo): both ranks take the same steps and end with the same weights."""
    ranks = _ranks(tmp_path, _fp8_worker)
    assert ranks[0]["float8"] == 18 and ranks[0]["nonfinite"] == 0
    assert ranks[0]["weights"] == ranks[1]["weights"] and all(math.isfinite(w) for w in ranks[0]["weights"])


def one_block(num_classes: int = 10) -> torch.nn.Module:
    """The compile test's model (``model.factory``): one conv-BN-ReLU block of the small CNN's and a linear head.
    Inductor compiles C++ for each kernel it generates, about 1.7 CPU-seconds each with a cold cache (a fresh
    clone's CI: its key holds the environment's paths): this model's fp16 step has a third of the small CNN's."""
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16),
                               torch.nn.ReLU(inplace=True), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(16, num_classes))


def _compile_worker(rank: int, port: int, folder: str) -> None:
    import functools

    from torch._dynamo.utils import counters
    world = _join(rank, port)
    out = {}
    inductor = torch.compile
    for compiled in ("eager", "aot_eager", "inductor"):  # amp_accum: fp16, 4 micro-batches, no_sync on the first 3
        torch.compile = functools.partial(inductor, backend="aot_eager") if compiled == "aot_eager" else inductor
        trainer = _trainer(world, folder, "amp_accum", train={"compile": compiled != "eager"},
                           model={"factory": "tests.test_ddp_trainer:one_block"})
        start = [p.detach().clone() for p in trainer.model.parameters()]
        batches = trainer.train_batches.epoch(0)
        counters.clear()
        for i in range(3):
            trainer.step_in_epoch = trainer.global_step = i
            trainer.optimizer_step(*next(batches))
        end = [p.detach().clone() for p in trainer.model.parameters()]
        torch.save({"start": start, "end": end}, Path(folder) / f"rank{rank}-{compiled}.pt")
        out[compiled] = {"compiled": counters["stats"]["unique_graphs"] > 0,  # dynamo captured the model
                         "weights": [float(p.double().sum()) for p in end]}
    torch.compile = inductor
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(out))
    distributed.shutdown()


@pytest.mark.slow
def test_torch_compile_under_ddp_keeps_the_ranks_in_step_with_eager_ddp(tmp_path):
    """train.compile with DDP (dynamo splits the graph at DDP's buckets) and accumulation's no_sync: every rank
    ends with the same weights, and those of eager DDP.

    What the comparison rests on: dynamo and AOTAutograd's graphs run with the eager kernels (the ``aot_eager``
    backend) give eager's weights bit for bit: the capture, the graph split at DDP's buckets and no_sync change no
    arithmetic. Inductor's generated kernels round fp16 at other points than eager's (it keeps fused intermediates
    in fp32), and how far that moves three steps depends on the model's conditioning, not on fp16's unit roundoff
    (the small CNN's first convolution: by 1.9% of its largest update after three steps on an Intel Xeon): for
    Inductor the test asserts what holds on any CPU, the ranks bit-identical and the weights trained. The model is
    one block of the small CNN's (``one_block``): Inductor's C++ for a third of the kernels."""
    ranks = _ranks(tmp_path, _compile_worker)
    assert ranks[0] == ranks[1]  # every rank runs the same kernels on the same all-reduced gradients
    assert not ranks[0]["eager"]["compiled"] and ranks[0]["aot_eager"]["compiled"] and ranks[0]["inductor"]["compiled"]
    eager, captured, inductor = (torch.load(tmp_path / f"rank0-{c}.pt") for c in ("eager", "aot_eager", "inductor"))
    for w0, we, wa, wi in zip(eager["start"], eager["end"], captured["end"], inductor["end"], strict=True):
        assert torch.equal(wa, we)
        assert torch.isfinite(wi).all() and not torch.equal(wi, w0)


def _agree_worker(rank: int, port: int, folder: str) -> None:
    from ampbench.errors import AmpbenchError
    world = _join(rank, port)
    distributed.check_agree(world, "the scale", 8192.0)  # the same everywhere: no error
    try:  # e.g. rank 1's machine has no checkpoint (no shared file system) while rank 0 resumes from epoch 2
        distributed.check_agree(world, "the checkpoint to resume from", (2, 64) if rank == 0 else None)
        outcome = "agreed"
    except AmpbenchError as err:
        outcome = str(err)
    (Path(folder) / f"rank{rank}.txt").write_text(outcome)
    distributed.shutdown()


def test_ranks_that_disagree_stop_together_with_a_message(tmp_path):
    _spawn(_agree_worker, str(tmp_path))
    outcomes = {(tmp_path / f"rank{r}.txt").read_text() for r in range(WORLD)}
    assert outcomes == {"the ranks disagree on the checkpoint to resume from: rank 0: (2, 64), rank 1: None"}
