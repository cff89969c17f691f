"""Data-parallel settings: what reaches a variant's run plan (ddp, gradient communication, the backend), what a
GPU machine cannot run is refused with the fix (env.check_distributed), the launcher's exit code, and how soon the
ranks agree to stop (2 gloo processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ampbench import config, env, runplan
from ampbench.errors import EnvironmentMismatch
from ampbench.train import distributed


def test_ddp_false_and_grad_comm_reach_the_plan(tmp_path):
    cfg = config.from_dict({"distributed": {"nproc_per_node": 2, "grad_comm": "bf16", "find_unused_parameters": True},
                            "variants": {"a": {"precision": "fp16"}, "b": {"precision": "fp16", "ddp": False},
                                         "c": {"precision": "fp16", "grad_comm": "fp16"}}})
    plans = {n: runplan.make_plan(cfg, n, "cuda") for n in cfg.variants}
    assert [(p.ddp, p.grad_comm, p.backend) for p in plans.values()] == [
        (True, "bf16", "nccl"), (False, "bf16", "nccl"), (True, "fp16", "nccl")]
    assert [p.find_unused_parameters for p in plans.values()] == [True, False, True]  # one process: no DDP flag
    assert config.variant_world(cfg, "b") == 1 and config.variant_world(cfg, "a") == 2
    runplan.write_plan(plans["c"], tmp_path / "plan.json")
    assert runplan.read_plan(tmp_path / "plan.json") == plans["c"]


GPU = {"name": "NVIDIA T4", "count": 1, "capability": "7.5", "bf16_supported": False}


@pytest.mark.parametrize(("changes", "info", "words"), [
    ({"nproc_per_node": 2}, {"gpu": GPU}, ["nproc_per_node = 2", "1 CUDA GPU(s)", "nproc_per_node: 1"]),
    ({"grad_comm": "bf16"}, {"gpu": {**GPU, "bf16_supported": True}, "nccl": [2, 8, 4]}, ["NCCL 2.10", "2.8.4"]),
    ({"grad_comm": "bf16"}, {"gpu": GPU, "nccl": [2, 21, 5]}, ["NVIDIA T4", "has none", "grad_comm: fp16"]),
])
def test_distributed_settings_a_gpu_machine_cannot_run_are_refused(changes, info, words):
    cfg = config.DistributedConfig(**changes)
    with pytest.raises(EnvironmentMismatch) as err:
        env.check_distributed(cfg, "cuda", {"cpu_count": 16, **info}, {cfg.grad_comm})
    for word in words:
        assert word in str(err.value)
    env.check_distributed(config.DistributedConfig(), "cuda", {"cpu_count": 16, **info}, {"none"})  # the defaults run


def test_the_launcher_ends_with_the_exit_code_a_rank_said_though_the_agent_stopped_it(tmp_path, monkeypatch, capsys):
    """A rank writes its message and exit code, then may be stopped by the elastic agent (SIGTERM: exit code -15)
    before it exits with its own: the stage still ends with that message, last, and the code the rank said."""
    import os

    import torch.distributed.run as run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ampbench.errors import RANK_ERRORS_ENV
    from ampbench.train import distributed

    def fake_run(args):
        folder = os.environ[RANK_ERRORS_ENV]
        with open(os.path.join(folder, "rank1"), "w") as f:
            f.write("2\nrank 1: params.yaml: train.batch_size = 31 does not split")
        missing = str(tmp_path / "none.json")
        raise ChildFailedError("train.py", {r: ProcessFailure(r, 100 + r, -15, missing) for r in (0, 1)})

    monkeypatch.setattr(run, "run", fake_run)
    with pytest.raises(SystemExit) as stop:
        distributed.torchrun(2, ["stages/train.py"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "error: rank 1: params.yaml: train.batch_size = 31 does not split"


@pytest.mark.parametrize("sig,said", [("SIGINT", "SIGINT (Ctrl-C)"), ("SIGTERM", "SIGTERM")])
def test_a_signal_to_the_launcher_ends_it_with_one_line_and_128_plus_the_signal(monkeypatch, capsys, sig, said):
    """The agent passed the signal on and closed the ranks: one line that says how to resume, not its traceback."""
    import signal

    import torch.distributed.run as run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    signum = getattr(signal, sig)

    def fake_run(args):
        raise SignalException(f"Process 7 got signal: {int(signum)}", sigval=signum)

    monkeypatch.setattr(run, "run", fake_run)
    kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # the launcher ignores both after
    try:
        with pytest.raises(SystemExit) as stop:
            distributed.torchrun(2, ["stages/train.py"])
    finally:
        for s, h in kept.items():
            signal.signal(s, h)
    assert stop.value.code == 128 + signum
    assert capsys.readouterr().err.strip().splitlines() == \
        [f"stopped by {said}: the next `dvc repro` resumes from the last checkpoint saved"]


def _stop_worker(rank: int, port: int, folder: str) -> None:
    from tests.test_distributed import _join, _trainer
    world = _join(rank, port)
    out = {}
    for every in (1, 3):  # a vote after every step (before a loss sync has timed them), then every third step
        trainer = _trainer(world, folder, "fp32", train={"batch_size": 8})  # 16 steps: the loss syncs at the end
        trainer.vote_every = every
        take = trainer.optimizer_step

        def stepping(x, y, *count, trainer=trainer, take=take):
            if rank == 1 and trainer.step_in_epoch == 2:  # a SIGTERM that reached rank 1 alone, in the third step
                trainer.stop_requested, trainer.stop_signal = True, 15
            return take(x, y, *count)

        trainer.optimizer_step = stepping
        row = trainer.run_epoch()
        trainer.stop_vote.close()  # the last vote in flight, before the next trainer votes on the same group
        out[every] = {"row": row, "at": trainer.step_in_epoch, "of": trainer.steps_per_epoch,
                      "stop": trainer.stop_now(), "signal": trainer.agreed_signal(),
                      "weights": [float(p.detach().double().sum()) for p in trainer.model.parameters()]}
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(out))
    distributed.shutdown()


def test_a_stop_seen_by_one_rank_stops_every_rank_two_steps_later_not_at_the_next_loss_sync(tmp_path):
    """The ranks' stop vote: a wish sent after step 3 is read by every rank after step 4, so all stop there
    (before, at the next loss sync: up to 25 steps, longer than a scheduler's grace on a slow model); voting every
    third step, the wish sent after step 3 is read after step 6."""
    from tests.test_distributed import _ranks
    found = _ranks(tmp_path, _stop_worker)
    ranks = [r["1"] for r in found]  # voting after every step
    assert ranks[0]["of"] == 16
    assert [r["at"] for r in ranks] == [4, 4] and all(r["stop"] and r["row"] is None for r in ranks)
    assert [r["signal"] for r in ranks] == [15, 15]  # rank 0 saw none itself: it exits 143 too, not 128
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the same steps taken
    # short steps vote every few (StopVote.every): sent after step 3, read at the next vote, after step 6
    spaced = [r["3"] for r in found]
    assert [r["at"] for r in spaced] == [6, 6] and all(r["stop"] for r in spaced)
    assert spaced[0]["weights"] == spaced[1]["weights"]
