"""Writes that survive a crash: every file of a run folder and the checkpoint goes through a temporary file that is
flushed, renamed and its folder flushed; a crash between write and rename leaves the old file and a temporary that
the next start removes; files get the mode a plain write would give (a team reads them)."""

from __future__ import annotations

import multiprocessing
import os
import stat

import pytest
import torch

from ampbench import data, results
from ampbench.config import DataConfig
from ampbench.train import checkpoint


def _run_files(folder):
    metrics = {"variant": "v", "final_acc": 0.5}
    tables = {"history": [{"epoch": 1, "train_loss": 2.0}], "numerics": []}
    results.write_run(folder, metrics, tables, [1.0, 2.0], '{"traceEvents": []}\n',
                      {"state_dict": {"w": torch.zeros(2)}})


def _crash_at(folder, n: int) -> None:
    """In a child: write the run folder, and die (as SIGKILL would) at its ``n``-th rename."""
    real, seen = os.replace, [0]

    def replace(src, dst):
        seen[0] += 1
        if seen[0] == n:
            os._exit(9)
        real(src, dst)
    os.replace = replace
    _run_files(folder)
    os._exit(0)


def test_a_crash_between_write_and_rename_at_every_file_leaves_no_result_and_no_temporary_after_the_next_start(
        tmp_path):
    done = tmp_path / "done"
    _run_files(done)
    files = sorted(p.name for p in done.iterdir())
    assert "metrics.json" in files and "model.pt" in files and not [f for f in files if f.startswith(".")]
    fork = multiprocessing.get_context("fork")
    for n in range(1, len(files) + 1):  # the n-th file's rename never happens
        run = tmp_path / f"crash{n}"
        child = fork.Process(target=_crash_at, args=(run, n))
        child.start()
        child.join(60)
        assert child.exitcode == 9
        left = [p.name for p in run.iterdir() if p.name.startswith(".")]
        assert len(left) == 1, left  # the one temporary the crash left
        assert results.read_runs(tmp_path).get(run.name) is None  # metrics.json is written last: not a result
        _run_files(run)  # the next start
        assert sorted(p.name for p in run.iterdir()) == files
        assert run.name in results.read_runs(tmp_path)


def test_a_checkpoint_cut_short_is_removed_at_the_next_start_and_never_resumed(tmp_path):
    ckpt = tmp_path / "ckpt"
    checkpoint.save(ckpt, {"fingerprint": "f", "epoch": 1})
    (ckpt / ".last.abc123.pt").write_bytes(b"half a checkpoint")
    assert checkpoint.load(ckpt, "f")["epoch"] == 1
    assert sorted(p.name for p in ckpt.iterdir()) == ["last.pt"]


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_run_files_checkpoints_and_the_prepared_data_get_a_plain_writes_mode(tmp_path, umask, monkeypatch):
    """mkstemp makes files 0600 and mkdtemp folders 0700: a team's other users could not read metrics.json,
    report.md or the prepared set on a shared host. They get what a plain write gives under the umask."""
    old = os.umask(umask)
    try:
        _run_files(tmp_path / "run")
        checkpoint.save(tmp_path / "ckpt", {"fingerprint": "f"})
        data.prepare(DataConfig(source="synthetic", train_size=8, test_size=8), 0, tmp_path / "prepared",
                     tmp_path / "raw")
    finally:
        os.umask(old)
    for f in [*(tmp_path / "run").iterdir(), tmp_path / "ckpt" / "last.pt", *(tmp_path / "prepared").iterdir()]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f
    assert stat.S_IMODE((tmp_path / "prepared").stat().st_mode) == 0o777 & ~umask


def test_every_write_is_flushed_to_disk_with_its_folder(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    results.atomic_write(tmp_path / "a.json", "{}\n")
    assert synced[0].startswith(str(tmp_path / ".a.json.")) and synced[1] == str(tmp_path)


def test_a_plain_mode_is_read_without_setting_the_umask(monkeypatch):
    """Setting the umask to 0 and back to read it would, for that moment, give any file another thread makes (the
    system monitor's, MLflow's, Inductor's) mode 0666: the umask is read from /proc/self/status instead."""
    real = os.umask(0o027)
    calls = []
    monkeypatch.setattr(os, "umask", lambda mask: (calls.append(mask), real)[1])
    try:
        assert results.plain_mode() == 0o640 and results.plain_mode(folder=True) == 0o750
        assert calls == []
    finally:
        monkeypatch.undo()
        os.umask(real)
