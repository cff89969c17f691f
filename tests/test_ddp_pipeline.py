"""Data-parallel training through the real pipeline: `dvc repro` with distributed.nproc_per_node: 2, torchrun
starting 2 gloo processes. One writer, one MLflow run per variant, the report's DDP section; SIGKILL of the whole
group and Ctrl-C or SIGTERM to torchrun, then a rerun that resumes to the uninterrupted run's history.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.conftest import verdict_of
from tests.test_distributed import WORLD

DDP_VARIANTS = {"fp32": {"precision": "fp32", "accum_steps": 1},            # 2 processes
                "fp32_1proc": {"precision": "fp32", "accum_steps": 1, "ddp": False},
                # bf16 compute (fp16's GradScaler under DDP: test_distributed), fp16 gradient communication
                "bf16_accum": {"precision": "bf16", "accum_steps": 2, "grad_comm": "fp16"},
                # FSDP2: the same bf16 and accumulation sharded, its gradients reduce-scattered in fp32
                "bf16_fsdp": {"precision": "bf16", "accum_steps": 2, "strategy": "fsdp"}}


TRAIN, BATCH = 512, 32  # 16 steps an epoch


def _ddp_params(variants: dict) -> dict:
    import copy

    import yaml

    from ampbench import sandbox
    params = sandbox.merge(copy.deepcopy(yaml.safe_load((sandbox.REPO_ROOT / "params.yaml").read_text())), {
        "device": "cpu", "data": {"source": "synthetic", "train_size": TRAIN, "test_size": 64},
        "model": {"arch": "small_cnn"}, "train": {"epochs": 3, "batch_size": BATCH, "warmup_steps": 2},
        "sweep": {"enabled": False}, "profile": {"steps": 1}, "amp": {"audit_batches": 1},
        "paired": {"enabled": False},  # it times one-process variants alone (test_steadiness; the pipeline test)
        "distributed": {"nproc_per_node": WORLD}})
    params["variants"] = variants
    return params


def _repro(repo: Path, **kw):
    import subprocess
    import sys

    from ampbench import sandbox
    return subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=sandbox.env_with_venv(),
                          capture_output=True, text=True, timeout=900, **kw)


@pytest.fixture(scope="module")
def ddp_pipeline(tmp_path_factory):
    from ampbench import sandbox
    repo = sandbox.create(tmp_path_factory.mktemp("ddp"), _ddp_params(DDP_VARIANTS))
    mp_ = pytest.MonkeyPatch()
    mp_.delenv("MLFLOW_TRACKING_URI", raising=False)
    proc = _repro(repo)
    mp_.undo()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return repo, proc


def _history(repo: Path, variant: str) -> list[list[str]]:
    rows = (repo / "reports" / "runs" / variant / "history.csv").read_text().splitlines()
    return [r.split(",")[:5] for r in rows]  # epoch, train loss, eval loss, eval accuracy, lr


def _same_history(rows: list[list[str]], reference: list[list[str]]) -> bool:
    """The same epochs, and the same losses, accuracy and lr to float32 rounding: resuming mid-epoch under DDP
    sums the epoch's loss over the ranks at the stop and again at the end, in another order than one run: fp32's
    bound for a sum of K terms in any order, K x its unit roundoff (2^-24), K the epoch's steps."""
    if len(rows) != len(reference) or rows[0] != reference[0]:
        return False
    bound = TRAIN // BATCH * 2.0 ** -24
    return all(a[0] == b[0] and [float(x) for x in a[1:]] == pytest.approx([float(x) for x in b[1:]], rel=bound)
               for a, b in zip(rows[1:], reference[1:], strict=True))


@pytest.mark.slow
def test_dvc_repro_trains_under_torchrun_with_one_writer(ddp_pipeline):
    from mlflow.tracking import MlflowClient
    repo, proc = ddp_pipeline
    assert "torchrun --standalone --nproc-per-node 2 stages/train.py --nproc-per-node 2" in proc.stdout
    metrics = {v: json.loads((repo / "reports" / "runs" / v / "metrics.json").read_text()) for v in DDP_VARIANTS}
    assert [metrics[v]["world_size"] for v in DDP_VARIANTS] == [2, 1, 2, 2]
    assert metrics["bf16_accum"]["grad_comm"] == "fp16" and metrics["bf16_accum"]["micro_batch_size"] == 8
    sharded = metrics["bf16_fsdp"]  # sharded, bf16 on the wire both ways but the reduce, as configured
    assert (sharded["strategy"], metrics["bf16_accum"]["strategy"]) == ("fsdp", "ddp")
    assert sharded["fsdp"]["blocks"] == ["0", "2", "4", "7"] and sharded["fsdp"]["param_dtype"] == "bfloat16"
    assert sharded["fsdp"]["wire_bytes_per_step"]["reduce_scatter"]["dtype"] == "float32"
    assert sharded["fsdp"]["wire_bytes_per_step"]["all_gather"]["per_step"] == 2 * 2  # 2 micro-batches, resharded
    assert "FSDP (bf16_fsdp) shards each of 4 blocks on its own, then the root: 0, 2, 4, 7" in proc.stdout
    assert metrics["fp32"]["backend"] == "gloo" and metrics["fp32"]["optimizer_steps"] == 3 * TRAIN // BATCH
    assert metrics["fp32"]["profile"]["communication"]["step_ms"] > 0
    for v in DDP_VARIANTS:  # one writer: one set of run files, one line saying so
        assert sorted(p.name for p in (repo / "reports" / "runs" / v).iterdir()) == sorted(
            ["grad_norm.csv", "history.csv", "loss_scale.csv", "metrics.json", "model.pt", "numerics.csv",
             "profile_trace.json",
             "step_times.json", "system.csv", ".gitignore"])
        assert proc.stdout.count(f"train@{v}: final accuracy") == 1
        assert [p.name for p in (repo / "checkpoints" / v).iterdir()] == ["COMPLETE"]
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("ampbench").experiment_id])
    names = sorted(r.info.run_name for r in runs)
    assert names == sorted([f"train@{v}" for v in DDP_VARIANTS] + ["report"])  # one MLflow run per variant
    report = (repo / "reports" / "report.md").read_text()
    assert "## Past one process: data-parallel training (DDP, FSDP)" in report
    assert ("FSDP (`bf16_fsdp`, 2 processes, bf16 gathered, fp32 reduced) against DDP (`bf16_accum`, gradients "
            "all-reduced in fp16): ") in report
    assert " Sharded with FSDP (counted): bf16_fsdp held " in verdict_of(report)
    # no step runs without its collectives: the profile's share of the step in them, gloo's labelled emulated
    assert re.search(r"\| bf16_fsdp \| 2 \| gloo \| fp32 reduce-scatter, bf16 all-gather \|.*\| \d+% in them "
                     r"\(profile, emulated: gloo\) \|", report)
    assert "| fp32 | 2 | gloo | fp32 |" in report and "`fp32_1proc`" in report
    assert "- Processes: 2 (torchrun, gloo backend) for fp32, bf16_accum, bf16_fsdp; one for fp32_1proc" in report
    assert "Data-parallel over 2 processes (gloo): fp32 ran " in verdict_of(report)  # the verdict says it
    summary = json.loads((repo / "reports" / "summary.json").read_text())
    [fsdp] = summary["scaling"]["fsdp"]  # sharded: 1/2 of the fp32 state per rank, counted as DDP's whole
    f = metrics["bf16_fsdp"]["fsdp"]
    # DDP: parameters, gradients, their buckets and SGD's momentum, all whole
    assert fsdp["against_memory_per_rank"] == 4 * (f["param_count"] + f["trained_count"] * 3)
    assert fsdp["memory_parts"]["parameters"] == -(-4 * f["param_count"] // 2) < fsdp["against_memory_per_rank"] / 3
    # 2 micro-batches, gathered for each forward and backward in bf16 (2 bytes; BatchNorm's in fp32), half sent by
    # each of 2 ranks
    import torch

    from ampbench import config, models
    net = models.build(config.ModelConfig(arch="small_cnn"), num_classes=10, image_size=32, device="cpu")
    norms = sum(q.numel() for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d) for q in m.parameters())
    assert fsdp["wire"]["all_gather"]["by_dtype"] == {"bfloat16": 2 * 2 * (f["param_count"] - norms) * 2 // 2,
                                                      "float32": 2 * 2 * norms * 4 // 2}
    assert fsdp["memory_parts"]["accumulated_gradients"] == 4 * f["trained_count"]  # whole until the last micro
    row = next(r for r in summary["scaling"]["rows"] if r["variant"] == "fp32")
    assert row["efficiency"] == pytest.approx(metrics["fp32"]["imgs_per_s"] / (2 * metrics["fp32_1proc"]["imgs_per_s"]))


@pytest.mark.slow
def test_sigkill_of_the_torchrun_group_then_dvc_repro_resumes_to_the_same_result(ddp_pipeline, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from ampbench import sandbox
    reference, _ = ddp_pipeline
    params = {**_ddp_params({"fp32": DDP_VARIANTS["fp32"]}), "mlflow": {"enabled": False}}  # resume alone
    repo = sandbox.create(tmp_path / "repo", params)
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=sandbox.env_with_venv(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt = repo / "checkpoints" / "fp32" / "repeat1" / "last.pt"
    deadline = time.time() + 300
    while not ckpt.exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    stage = [p for p in psutil.process_iter(["cmdline", "cwd"]) if p.info["cwd"] == str(repo)
             and "stages/train.py" in " ".join(p.info["cmdline"] or [])]
    # DVC runs the cmd through $SHELL, or /bin/sh when it is unset: dash stays as torchrun's parent, bash
    # execs it. The workers are the leaves; their one parent is torchrun.
    workers = [p for p in stage if not p.children()]
    launchers = {p.ppid() for p in workers}
    assert len(workers) == WORLD and len(launchers) == 1, stage
    workers.append(psutil.Process(launchers.pop()))
    os.killpg(proc.pid, signal.SIGKILL)  # dvc and torchrun; torchrun's workers sit in sessions of their own
    proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"workers outlived torchrun: {alive}"
    again = _repro(repo)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "[fp32] resuming from the checkpoint at epoch" in again.stdout
    assert _history(repo, "fp32") == _history(reference, "fp32")  # the same result as the uninterrupted run


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_rank_after_the_same_step_and_resumes(ddp_pipeline, tmp_path):
    """SIGTERM (Slurm at a time limit, docker stop, Kubernetes) to torchrun at a seeded random point of epoch 2:
    torchrun passes it on, the ranks agree on the step to stop after (StopVote; test_ddp_settings says how soon),
    rank 0 saves it, the launcher exits 143 with one line, and the rerun resumes mid-epoch to the uninterrupted
    run's history."""
    import random
    import signal
    import subprocess
    import sys
    import time

    from ampbench import sandbox
    reference, _ = ddp_pipeline
    sig = "SIGTERM"  # Ctrl-C takes the same path in the ranks (test_resume) and the launcher (test_ddp_settings)
    cmd = [sys.executable, "stages/train.py", "--nproc-per-node", str(WORLD),  # becomes torchrun, as dvc.yaml runs it
           "--plan", "reports/plans/fp32.json", "--data", "data/prepared", "--env", "reports/env.json",
           "--out", str(tmp_path / "out"), "--checkpoints", str(tmp_path / "ckpt")]
    proc = subprocess.Popen(cmd, cwd=reference, env=sandbox.env_with_venv(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    ckpt = tmp_path / "ckpt" / "repeat1" / "last.pt"
    deadline = time.time() + 300
    while not ckpt.exists():  # the end of epoch 1
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    time.sleep(random.Random(sig).uniform(0, 0.2))  # somewhere in epoch 2 (an epoch: 16 steps, half a second)
    signum = getattr(signal, sig)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, out[-2000:] + err[-2000:]
    assert "Traceback" not in err and "stopped by SIGTERM: the next `dvc repro` resumes" in err, err[-3000:]
    assert "SIGTERM: stopping within the ranks' next two votes" in out
    # each rank's stop line; the ranks share one stderr, so two lines can arrive interleaved on one
    stopped = re.findall(r"rank (\d+): \[fp32\] interrupted at (epoch \d+, step \d+)", out + err)
    assert sorted(rank for rank, _ in stopped) == [str(r) for r in range(WORLD)], out[-2000:] + err[-2000:]
    assert len({where for _, where in stopped}) == 1  # every rank, at the same step
    assert not (tmp_path / "out" / "metrics.json").exists()
    again = subprocess.run(cmd, cwd=reference, env=sandbox.env_with_venv(), capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "[fp32] resuming from the checkpoint at epoch" in again.stdout
    rows = (tmp_path / "out" / "history.csv").read_text().splitlines()
    assert _same_history([r.split(",")[:5] for r in rows], _history(reference, "fp32"))
    from tests.test_resume import weights_digest  # the same steps on the same all-reduced gradients, bit for bit
    assert weights_digest(tmp_path / "out" / "model.pt") == weights_digest(reference / "reports/runs/fp32/model.pt")


@pytest.mark.slow
def test_a_rank_that_stops_with_a_message_ends_the_stage_with_it_not_torchruns_traceback(tmp_path):
    """Under torchrun, a rank that stops with ampbench's message (here every rank: a plan whose batch does not split
    over the processes, a ConfigError) ends the stage with that message last and its exit code (2), not torchrun's
    ChildFailedError traceback and exit code 1."""
    import dataclasses
    import subprocess
    import sys

    from ampbench import config, data, runplan, sandbox
    data.prepare(config.DataConfig(source="synthetic", train_size=64, test_size=32), 0, tmp_path / "prepared",
                 tmp_path / "raw")
    cfg = config.from_dict({**_ddp_params({"fp32": DDP_VARIANTS["fp32"]}), "mlflow": {"enabled": False}})
    plan = runplan.make_plan(cfg, "fp32", "cpu")
    runplan.write_plan(dataclasses.replace(plan, train=dataclasses.replace(plan.train, batch_size=31)),
                       tmp_path / "fp32.json")
    (tmp_path / "env.json").write_text('{"torch": "x", "cuda_runtime": null, "cpu_model": "cpu", "gpu": null}')
    proc = subprocess.run([sys.executable, "stages/train.py", "--nproc-per-node", str(WORLD), "--plan",
                           str(tmp_path / "fp32.json"), "--data", str(tmp_path / "prepared"), "--env",
                           str(tmp_path / "env.json"), "--out", str(tmp_path / "out"), "--checkpoints",
                           str(tmp_path / "ckpt"), "--params", str(tmp_path / "none.yaml")],
                          cwd=sandbox.REPO_ROOT, env=sandbox.env_with_venv(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.match(r"error: rank \d: params.yaml: train.batch_size = 31 does not split into", last), last
