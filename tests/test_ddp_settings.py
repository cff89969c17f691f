"""Data-parallel settings, without processes: what reaches a variant's run plan (ddp, gradient communication,
the backend) and what a GPU machine cannot run is refused with the fix (env.check_distributed)."""

from __future__ import annotations

import pytest

from ampbench import config, env, runplan
from ampbench.errors import EnvironmentMismatch


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
