"""Streaming placement: batches fed from host memory by DataLoader workers, exact per (seed, epoch, index), and
the choice between device and stream."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from ampbench import config, data, env, runplan
from ampbench.config import optim
from ampbench.data import batches, stream
from ampbench.errors import EnvironmentMismatch
from tests.conftest import verdict_of

MEAN, STD = [0.0] * 3, [1 / 255] * 3  # the identity normalisation: outputs are the raw pixels


def _set(n=70, side=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(1, 255, (n, 3, side, side), dtype=torch.uint8, generator=g),
            torch.arange(n, dtype=torch.int64))


def _stream(x, y, batch=16, workers=0, **kw):
    kw = {"augment": True, "shuffle": True, "channels_last": True, "seed": 3, "pad": 2, **kw}
    return stream.StreamBatches(x, y, batch, MEAN, STD, device="cpu", workers=workers, **kw)


def test_batches_cover_the_set_and_are_the_same_with_any_number_of_workers():
    x, y = _set()
    one = list(_stream(x, y).epoch(1))
    assert [len(b) for _, b in one] == [16, 16, 16, 16, 6]
    assert sorted(torch.cat([b for _, b in one]).tolist()) == list(range(70))
    assert one[0][0].dtype == torch.float32 and one[0][0].is_contiguous(memory_format=torch.channels_last)
    two = list(_stream(x, y, workers=2).epoch(1))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(one, two, strict=True))
    other = list(_stream(x, y).epoch(2))
    assert not torch.equal(one[0][1], other[0][1])  # another epoch, another order


def test_each_image_is_cropped_and_flipped_from_seed_epoch_and_index_alone():
    x, y = _set(n=20)
    xb, yb = next(_stream(x, y, batch=20).epoch(5))
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for out, label in zip(xb, yb.tolist(), strict=True):
        dy, dx, flip = stream.sample_draws(3, 5, label, 2)  # the label is the image's index here
        crop = padded[label, :, dy:dy + 8, dx:dx + 8]
        assert torch.equal(out, (crop.flip(-1) if flip else crop).float())
    draws = {stream.sample_draws(3, 5, i, 2) for i in range(20)}
    assert len(draws) > 5  # the draws differ from image to image
    plain, _ = next(_stream(x, y, batch=20, augment=False, shuffle=False).epoch(0))
    assert torch.equal(plain, x.float())  # evaluation: the images as they are


def test_a_resumed_epoch_starts_at_its_batch_and_ranks_stream_their_slices():
    x, y = _set()
    whole = list(_stream(x, y, drop_last=True).epoch(0))
    assert [b.tolist() for _, b in _stream(x, y, drop_last=True).epoch(0, start=2)] == \
        [b.tolist() for _, b in whole[2:]]
    ranks = [list(_stream(x, y, drop_last=True, shard=(r, 2)).epoch(0)) for r in range(2)]
    for i, (xb, yb) in enumerate(whole):
        assert torch.equal(torch.cat([ranks[0][i][1], ranks[1][i][1]]), yb)
        assert torch.equal(torch.cat([ranks[0][i][0], ranks[1][i][0]]), xb)  # augmented as in one process


def test_device_batches_resume_at_their_batch_too():
    x, y = _set()
    b = batches.DeviceBatches(x, y, 16, MEAN, STD, augment=True, shuffle=True, channels_last=True, seed=3, pad=2)
    whole = list(b.epoch(0))
    resumed = list(b.epoch(0, start=3))
    assert all(torch.equal(a[0], c[0]) for a, c in zip(whole[3:], resumed, strict=True)) and len(resumed) == 2


@pytest.mark.parametrize("augment", [True, False])
def test_device_batches_made_in_chunks_are_the_batches_made_one_by_one(augment):
    """A chunk of batches gathered and normalised at once gives each batch as made alone, bit for bit, resumed
    mid-chunk too; the normalisation is (x - mean) / std per channel, as the per-channel broadcast computes it."""
    x, y = _set(n=200)
    mean, std = [0.49, 0.48, 0.45], [0.25, 0.24, 0.26]
    b = batches.DeviceBatches(x, y, 8, mean, std, augment=augment, shuffle=True, channels_last=True, seed=3, pad=2)
    assert b.chunk == batches.MAX_CHUNK  # 8 images of 8x8: many batches to a chunk
    chunked = list(b.epoch(1))
    b.chunk = 1
    alone = list(b.epoch(1))
    assert len(chunked) == 25 and all(torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
                                      for a, c in zip(chunked, alone, strict=True))
    b.chunk = 7
    assert all(torch.equal(a[0], c[0]) for a, c in zip(chunked[3:], b.epoch(1, start=3), strict=True))
    plain = batches.DeviceBatches(x, y, 8, mean, std, augment=False, shuffle=False, channels_last=True)
    first = next(plain.epoch(0))[0]
    inv = 1 / (torch.tensor(std).view(1, 3, 1, 1) * 255)
    assert torch.equal(first, torch.addcmul(-torch.tensor(mean).view(1, 3, 1, 1) * 255 * inv, x[:8], inv))
    assert first.is_contiguous(memory_format=torch.channels_last)


def test_workers_ignore_ctrl_c(monkeypatch):
    """A terminal's Ctrl-C reaches the workers as well: they must not die with a KeyboardInterrupt."""
    real = stream._Crops.__getitem__

    def interrupted(self, key):
        if torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, key)

    monkeypatch.setattr(stream._Crops, "__getitem__", interrupted)
    x, y = _set()
    assert len(list(_stream(x, y, workers=1).epoch(0))) == 5


def test_prepared_set_streams_memory_mapped(tmp_path):
    data.prepare(config.DataConfig(source="synthetic", train_size=64, test_size=32), 0, tmp_path / "p",
                 tmp_path / "raw")
    resident = data.load_prepared(tmp_path / "p", "cpu")
    mapped = data.load_prepared(tmp_path / "p", "cpu", stream=True)
    assert torch.equal(resident["train"][0], mapped["train"][0])
    assert _mapped_file(mapped["train"][0]).endswith("train.pt")  # a file mapping, not a copy in memory
    assert not _mapped_file(resident["train"][0]).endswith("train.pt")


def _mapped_file(t: torch.Tensor) -> str:
    """The file whose mapping holds ``t``'s memory (/proc/self/maps), or "" for anonymous memory."""
    ptr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(v, 16) for v in fields[0].split("-"))
        if lo <= ptr < hi:
            return fields[5] if len(fields) > 5 else ""
    return ""


def test_auto_places_the_set_on_the_device_when_it_fits_and_streams_it_otherwise(monkeypatch):
    desc = {"image_size": 32, "train_count": 50_000, "test_count": 10_000}
    nbytes = data.resident_bytes(desc)  # about 0.2 GiB
    gpu = {"gpu": {"name": "Test GPU", "total_memory_bytes": 8 * 2**30}}
    assert env.choose_placement("auto", nbytes, 2**30, desc, "cuda", gpu)[0] == "device"
    monkeypatch.setenv(env.MEMORY_CAP_ENV, str(2**30))
    where, why = env.choose_placement("auto", nbytes, 2**29, desc, "cuda", gpu)
    assert where == "stream" and "capped by AMPBENCH_DEVICE_MEMORY_BYTES" in why and "streams" in why
    assert env.choose_placement("stream", 1, 0, desc, "cuda", gpu)[0] == "stream"
    monkeypatch.setenv(env.MEMORY_CAP_ENV, str(2**27))
    with pytest.raises(EnvironmentMismatch, match="set data.placement: stream"):
        env.choose_placement("device", nbytes, 0, desc, "cuda", gpu)
    monkeypatch.setenv(env.MEMORY_CAP_ENV, "8GB")
    with pytest.raises(EnvironmentMismatch, match="AMPBENCH_DEVICE_MEMORY_BYTES = '8GB' is not a number of bytes"):
        env.choose_placement("auto", nbytes, 0, desc, "cuda", gpu)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)  # taskset / a container
    assert env.usable_cores() == 3
    train = config.from_dict({"train": {"optimizer": "adamw"}}).train
    assert optim.training_bytes([(1000,)], train) == 16_004  # and AdamW's step count
    assert optim.training_bytes([(1000,)], config.from_dict({}).train) == 12_000


def test_a_streaming_plan_says_so_and_a_device_plan_file_is_unchanged(tmp_path):
    cfg = config.from_dict({"data": {"placement": "stream", "workers": -1}, "distributed": {"nproc_per_node": 2}})
    assert config.resolve_workers(cfg.data.workers, 16, 2) == 8 and config.resolve_workers(-1, None, 4) == 1
    device_plan = runplan.make_plan(cfg, "fp32", "cpu")
    runplan.write_plan(device_plan, tmp_path / "d.json")
    assert "placement" not in json.loads((tmp_path / "d.json").read_text())  # existing plans do not retrain
    plan = runplan.make_plan(cfg, "fp32", "cpu", placement="stream", workers=8)
    runplan.write_plan(plan, tmp_path / "s.json")
    back = runplan.read_plan(tmp_path / "s.json")
    assert (back.placement, back.workers) == ("stream", 8) and back == plan
    with pytest.raises(config.ConfigError, match="placement = 'disk' is not allowed"):
        config.from_dict({"data": {"placement": "disk"}})


def test_the_verdict_calls_a_streamed_variant_input_bound(tmp_path):
    from ampbench import report, results
    env_ = {"torch": "2.x", "cuda_runtime": None, "cpu_model": "Test CPU", "cpu_count": 2, "gpu": None}
    for name, prec, ms, share in (("fp32", "fp32", 300.0, 0.05), ("amp", "fp16", 100.0, 0.38)):
        metrics = {"variant": name, "precision": prec, "accum_steps": 1, "batch_size": 256, "epochs": 1,
                   "imgs_per_s": 256 / ms * 1000, "step_time_ms": {"median": ms, "p10": ms, "p90": ms, "n": 5},
                   "final_acc": 0.9, "skipped_steps": 0, "arch": "resnet18", "data_time_fraction": share,
                   "data_placement": "stream", "data_workers": 2}
        results.write_run(tmp_path / "runs" / name, metrics, {}, [ms] * 5)
    report.build(tmp_path / "runs", env_, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "amp"])
    verdict = verdict_of((tmp_path / "r.md").read_text())
    assert "Input-bound: the CPU waited 38% of each amp step for data: a faster precision cannot speed that " \
           "part; raise data.workers (2 now)" in verdict
    assert "each fp32 step" not in verdict  # 5%: not input-bound


def test_one_set_of_workers_serves_every_epoch(monkeypatch):
    """Workers start once, at the first batch (a warm-up step), not again at each epoch's first, timed, step."""
    real = stream._Crops.__getitem__

    def tagged(self, key):
        x, y = real(self, key)
        return x, torch.full_like(y, os.getpid())

    monkeypatch.setattr(stream._Crops, "__getitem__", tagged)
    x, y = _set()
    b = _stream(x, y, workers=1)
    next(b.epoch(0))  # a probe's single batch, as the trainer takes one before training
    pids = {int(pid) for e in range(3) for _, labels in b.epoch(e) for pid in labels.tolist()}
    assert len(pids) == 1 and os.getpid() not in pids
