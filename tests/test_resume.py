"""Interrupted runs: SIGKILL and Ctrl-C resume from the checkpoint to the same result as an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ampbench import config, data, runplan
from ampbench.sandbox import REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    data.prepare(config.DataConfig(source="synthetic", train_size=2048, test_size=128), 0, root / "prepared",
                 root / "raw")
    (root / "env.json").write_text(json.dumps({"torch": "x", "cuda_runtime": None, "cpu_model": "cpu", "gpu": None}))
    (root / "params.yaml").write_text("mlflow: {enabled: false}\n")  # the runs' tracking: the subject is resuming
    return root


def _plan(root: Path, name: str, lr: float = 0.1, placement: str = "device") -> Path:
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "small_cnn"}, "mlflow": {"enabled": False},
                            "train": {"epochs": 4, "batch_size": 64, "warmup_steps": 2, "lr": lr},
                            "profile": {"steps": 0}})
    path = root / f"{name}.json"
    runplan.write_plan(runplan.make_plan(cfg, "fp32", "cpu", placement=placement, workers=2), path)
    return path


def _cmd(root: Path, plan: Path, out: str) -> list[str]:
    return [sys.executable, str(REPO_ROOT / "stages" / "train.py"), "--plan", str(plan), "--data",
            str(root / "prepared"), "--env", str(root / "env.json"), "--out", str(root / out),
            "--checkpoints", str(root / f"ckpt-{out}"), "--params", str(root / "params.yaml")]


def weights_digest(model_pt: Path) -> str:
    """The final weights' bytes, every tensor in order: a resumed run's equal an uninterrupted one's bit for bit."""
    import hashlib

    import torch
    digest = hashlib.sha256()
    for name, tensor in torch.load(model_pt, weights_only=True)["state_dict"].items():
        digest.update(name.encode() + tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _history(root: Path, out: str) -> list[dict]:
    m = json.loads((root / out / "metrics.json").read_text())
    rows = (root / out / "history.csv").read_text().splitlines()
    return [m["final_acc"], m["final_loss"], m["optimizer_steps"], [r.split(",")[:4] for r in rows],
            weights_digest(root / out / "model.pt")]


@pytest.fixture(scope="module")
def reference(setup):
    proc = subprocess.run(_cmd(setup, _plan(setup, "ref"), "ref"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [p.name for p in (setup / "ckpt-ref").iterdir()] == ["COMPLETE"]  # cleared once results are on disk
    return _history(setup, "ref")


def _start_and_wait_for_checkpoint(root: Path, cmd: list[str], out: str, **kw) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    ckpt = root / f"ckpt-{out}" / "repeat1" / "last.pt"
    deadline = time.time() + 300
    while not ckpt.exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.time() < deadline
        time.sleep(0.02)
    return proc


def test_sigkill_mid_run_resumes_to_the_same_result(setup, reference):
    cmd = _cmd(setup, _plan(setup, "kill"), "kill")
    proc = _start_and_wait_for_checkpoint(setup, cmd, "kill")
    time.sleep(0.15)  # into the next epoch
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (setup / "kill" / "metrics.json").exists()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming from the checkpoint at epoch" in again.stdout
    assert _history(setup, "kill") == reference


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])  # Ctrl-C; Slurm, docker stop, Kubernetes
def test_a_stop_signal_stops_at_a_step_boundary_and_resumes(setup, reference, sig):
    name = f"stop{int(sig)}"
    cmd = _cmd(setup, _plan(setup, name), name)
    proc = _start_and_wait_for_checkpoint(setup, cmd, name)
    time.sleep(random.Random(int(sig)).uniform(0.0, 0.3))  # at some step of the second epoch
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert "interrupted at epoch" in err and "run `dvc repro` to resume" in err and "Traceback" not in err
    assert ("Ctrl-C" if sig == signal.SIGINT else "SIGTERM") + ": stopping after this step" in out
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming from the checkpoint" in again.stdout
    assert _history(setup, name) == reference


def test_checkpoint_from_other_params_is_discarded(setup):
    proc = _start_and_wait_for_checkpoint(setup, _cmd(setup, _plan(setup, "a"), "other"), "other")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    changed = subprocess.run(_cmd(setup, _plan(setup, "b", lr=0.05), "other"), capture_output=True, text=True,
                             timeout=600)
    assert changed.returncode == 0, changed.stderr[-2000:]
    assert "made with different params or data (or by an older ampbench); discarding it" in changed.stdout
    assert "resuming" not in changed.stdout


def test_killed_dvc_repro_resumes_from_the_persisted_checkpoint(tmp_path):
    """SIGKILL to the whole `dvc repro` (DVC and the stage); the next `dvc repro` resumes the train stage."""
    import os

    import yaml

    from ampbench import sandbox
    params = sandbox.merge(yaml.safe_load((REPO_ROOT / "params.yaml").read_text()), {
        "device": "cpu", "data": {"source": "synthetic", "train_size": 2048, "test_size": 128},
        "model": {"arch": "small_cnn"}, "train": {"epochs": 4, "batch_size": 64, "warmup_steps": 2},
        "mlflow": {"enabled": False}, "sweep": {"enabled": False}, "profile": {"steps": 0},
        "paired": {"enabled": False}})  # lean: resume alone
    params["variants"] = {"fp32": {"precision": "fp32", "accum_steps": 1}}
    repo = sandbox.create(tmp_path / "repo", params)
    cmd = [sys.executable, "-m", "dvc", "repro"]
    proc = subprocess.Popen(cmd, cwd=repo, env=sandbox.env_with_venv(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt = repo / "checkpoints" / "fp32" / "repeat1" / "last.pt"
    deadline = time.time() + 300
    while not ckpt.exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    again = subprocess.run(cmd, cwd=repo, env=sandbox.env_with_venv(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "[fp32] resuming from the checkpoint at epoch" in again.stdout
    assert json.loads((repo / "reports" / "runs" / "fp32" / "metrics.json").read_text())["optimizer_steps"] == 128
    assert [p.name for p in (repo / "checkpoints" / "fp32").iterdir()] == ["COMPLETE"]


@pytest.fixture(scope="module")
def stream_reference(setup):
    proc = subprocess.run(_cmd(setup, _plan(setup, "sref", placement="stream"), "sref"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return _history(setup, "sref")


def test_streamed_run_resumes_mid_epoch_after_ctrl_c_to_its_workers_too(setup, stream_reference):
    """Ctrl-C from a terminal reaches the whole process group, DataLoader workers included: they ignore it, the
    run stops at a step boundary mid-epoch, and resumes there to the uninterrupted streamed run's history."""
    cmd = _cmd(setup, _plan(setup, "sint", placement="stream"), "sint")
    proc = _start_and_wait_for_checkpoint(setup, cmd, "sint", start_new_session=True)
    time.sleep(0.3)  # into the next epoch, its workers running
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted at epoch" in err and "Traceback" not in err and "KeyboardInterrupt" not in err
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    resumed = again.stdout.split("resuming from the checkpoint at epoch ")[1]
    assert not resumed.split(" of ")[0].endswith("step 0")  # mid-epoch: the streamed batches start where it stopped
    assert _history(setup, "sint") == stream_reference


def test_streamed_run_resumes_after_sigkill(setup, stream_reference):
    cmd = _cmd(setup, _plan(setup, "skill", placement="stream"), "skill")
    proc = _start_and_wait_for_checkpoint(setup, cmd, "skill", start_new_session=True)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)  # the training process and its workers
    proc.wait()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming from the checkpoint at epoch" in again.stdout
    assert _history(setup, "skill") == stream_reference


def test_a_second_sigterm_aborts_with_143_and_the_handler_writes_to_no_python_stream(monkeypatch, capfd):
    """The first signal asks for a stop and says so; the second aborts at once, exit 128 + its number (a second
    SIGTERM 143, not Ctrl-C's 130). The handler writes its line to the file descriptor itself: a print there, when
    the signal lands inside a blocked write to stdout, raises "reentrant call inside BufferedWriter"."""
    from types import SimpleNamespace

    from ampbench.errors import run_cli
    from ampbench.train import distributed, runner

    def reentrant(*args, **kwargs):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stdout>'>")

    monkeypatch.setattr(runner.tqdm, "write", reentrant)
    monkeypatch.setattr("builtins.print", reentrant)
    trainer = SimpleNamespace(stop_requested=False, stop_signal=0, world=distributed.SINGLE)

    def stage():
        with runner.stop_on_signal(trainer):
            handler = signal.getsignal(signal.SIGTERM)
            handler(signal.SIGTERM, None)
            assert trainer.stop_requested and trainer.stop_signal == signal.SIGTERM
            try:
                handler(signal.SIGTERM, None)
            finally:
                monkeypatch.undo()  # run_cli's own line is a print

    with pytest.raises(SystemExit) as stop:
        run_cli(stage)
    assert stop.value.code == 128 + signal.SIGTERM
    out, err = capfd.readouterr()
    assert "SIGTERM: stopping after this step and saving a checkpoint" in out
    assert err.strip() == "aborted by a second SIGTERM"


def test_a_sigterm_to_ampbench_repro_reaches_dvc_which_dies_and_its_stage_stops_with_a_checkpoint(setup, tmp_path):
    """``docker stop`` with `ampbench repro` (`make repro`) as the container's PID 1: the SIGTERM reaches it alone,
    and it passes it to DVC, which forwards nothing to the stage it runs and dies of it (as behind tini). The stage
    hears its parent's death as a SIGTERM (PR_SET_PDEATHSIG), stops at a step boundary and saves a checkpoint, its
    output (DVC's pipes, now without a reader) sent nowhere; `ampbench repro` waits for it, as a PID 1 must (its
    exit takes the container down), and exits 143."""
    import shlex

    import psutil
    import torch
    import yaml

    from ampbench.sandbox import env_with_venv
    name = "dvcterm"
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": {"cmd": shlex.join(_cmd(
        setup, _plan(setup, name), name))}}}))
    env = {**env_with_venv(), "SHELL": "/bin/bash"}  # DVC runs a stage as $SHELL -c '<cmd>'
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=repo, env=env, check=True, timeout=120)
    # as a container runs it: PID 1 of its own PID namespace (root may make one), whom the kernel gives no signal
    # it has no handler for
    pid1 = shutil.which("unshare") is not None and subprocess.run(  # root with the right to (not in every container)
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode == 0
    top = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc"] * pid1 + ["ampbench", "repro"], cwd=repo,
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = setup / f"ckpt-{name}" / "repeat1" / "last.pt"
    deadline = time.time() + 300
    while not ckpt.exists():  # the first epoch's checkpoint
        assert top.poll() is None and time.time() < deadline
        time.sleep(0.02)
    repro = psutil.Process(top.pid).children()[0] if pid1 else psutil.Process(top.pid)
    below = repro.children(recursive=True)
    stage = next(p for p in below if "train.py" in " ".join(p.cmdline()))
    dvc = next(p for p in below if p.cmdline()[1:4] == ["-m", "dvc", "repro"])
    time.sleep(0.1)  # into the second epoch
    repro.send_signal(signal.SIGTERM)
    assert top.wait(120) == 143
    assert not dvc.is_running() and not stage.is_running()  # waited for, not left behind
    # stopped: not trained to the end, orphaned (before, the stage trained on and wrote its results), with a
    # checkpoint to resume from (the stop's, or the epoch boundary's when the signal came as it was saved)
    assert not (setup / name / "metrics.json").exists()
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert 1 <= state["epoch"] < 4
