"""Image folders as users have them (mixed formats and colour modes, stray files, unreadable images), streamed from
their files, and the whole pipeline on a generated JPEG folder that does not fit the (capped) device."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from ampbench import config, data, env
from ampbench.config import DataConfig
from ampbench.data import stream
from ampbench.errors import DataError, EnvironmentMismatch
from ampbench.sandbox import REPO_ROOT


def _mixed_folder(root: Path, per_class: int = 12, size=(14, 10), seed: int = 0) -> None:
    """Two classes of JPEG, PNG (greyscale), GIF (palette), CMYK JPEG and RGBA PNG, plus what real folders hold:
    a stray text file, a hidden file, an image that is not one and a truncated JPEG."""
    rng = np.random.default_rng(seed)
    for c in ("ant", "bee"):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            im = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
            kind = i % 5
            if kind == 0:
                im.save(root / c / f"{i}.jpg", quality=90)
            elif kind == 1:
                im.convert("L").save(root / c / f"{i}.png")
            elif kind == 2:
                im.convert("P").save(root / c / f"{i}.gif")
            elif kind == 3:
                im.convert("CMYK").save(root / c / f"{i}.jpeg")
            else:
                im.convert("RGBA").save(root / c / f"{i}.PNG")
    (root / "ant" / "notes.txt").write_text("labels checked by hand")
    (root / "ant" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (root / "bee" / "fake.jpg").write_bytes(b"<html>not found</html>")
    Image.fromarray(rng.integers(0, 256, (96, 96, 3), dtype=np.uint8)).save(root / "bee" / "cut.jpg")
    whole = (root / "bee" / "cut.jpg").read_bytes()
    (root / "bee" / "cut.jpg").write_bytes(whole[: len(whole) // 2])  # the header reads, the pixels do not


def test_a_real_folder_skips_and_names_what_it_cannot_use_the_same_way_in_every_stage(tmp_path):
    root = tmp_path / "imgs"
    _mixed_folder(root)
    cfg = DataConfig(source="folder", path=str(root), image_size=12, test_size=4)
    desc = data.describe(cfg)
    assert desc["not_images"] == ["ant/notes.txt"]  # the hidden file is ignored, the text file named
    assert [p for p, _ in desc["unreadable"]] == ["bee/fake.jpg"]  # its header is not an image's
    lines = data.folder.bad_file_lines(desc)
    assert "ant/notes.txt" in lines[0] and "bee/fake.jpg" in lines[1] and "data.bad_files: skip" in lines[1]
    assert (desc["train_count"], desc["test_count"]) == (21, 4)  # 24 images + the cut one, less the fake one
    tensors = data.prepare(cfg, 0, tmp_path / "t", tmp_path / "raw")
    files = data.prepare(cfg, 0, tmp_path / "f", tmp_path / "raw", form="files")
    for meta in (tensors, files):  # the decode finds the cut JPEG, whose header read
        assert [p for p, _ in meta["unreadable"]] == ["bee/cut.jpg", "bee/fake.jpg"]
        assert (meta["train_count"], meta["test_count"]) == (20, 4)
    assert not (tmp_path / "f" / "train.pt").exists() and (tmp_path / "f" / data.FILE_LIST).is_file()
    assert files["form"] == "files" and files["image_shape"] == tensors["image_shape"] == [3, 12, 12]
    assert files["mean"] == pytest.approx(tensors["mean"], abs=2e-6)
    assert files["std"] == pytest.approx(tensors["std"], abs=2e-6)
    resident, listed = data.load_prepared(tmp_path / "t", "cpu"), data.load_prepared(tmp_path / "f", "cpu", stream=True)
    for split in ("train", "test"):  # the same images, labels and pixels in both forms
        assert torch.equal(resident[split][1], listed[split][1])
        assert torch.equal(resident[split][0], listed[split][0][list(range(len(listed[split][1])))])
    grey = Image.open(root / "ant" / "1.png").convert("RGB").resize((12, 12), Image.Resampling.BILINEAR)
    from torchvision.datasets.folder import IMG_EXTENSIONS
    from torchvision.transforms.functional import pil_to_tensor
    assert torch.equal(data.folder.decode_image(root / "ant" / "1.png", 12), pil_to_tensor(grey))
    assert (*IMG_EXTENSIONS, ".gif") == data.folder.IMG_EXTENSIONS  # ImageFolder's, and GIF
    with pytest.raises(DataError, match="for streaming"):
        data.load_prepared(tmp_path / "f", "cpu")  # a listed folder is for streaming only

    strict = DataConfig(source="folder", path=str(root), image_size=12, test_size=4, bad_files="stop")
    with pytest.raises(DataError) as err:
        data.describe(strict)
    assert "bee/fake.jpg" in str(err.value) and "data.bad_files: skip" in str(err.value)
    (root / "bee" / "fake.jpg").unlink()
    assert data.describe(strict)["train_count"] == 21  # the header check passes the cut JPEG...
    with pytest.raises(DataError) as err:  # ...and the data stage stops on it, naming it
        data.prepare(strict, 0, tmp_path / "s", tmp_path / "raw", form="files")
    assert "bee/cut.jpg" in str(err.value) and not (tmp_path / "s").exists()


def test_the_header_check_is_reused_while_the_folder_is_unchanged(tmp_path, monkeypatch):
    root = tmp_path / "imgs"
    _mixed_folder(root, per_class=4)
    cfg = DataConfig(source="folder", path=str(root), image_size=12, test_size=2)
    first = data.describe(cfg)
    calls = []
    monkeypatch.setattr(data.folder, "header_problem", lambda p: calls.append(p))
    assert data.describe(cfg, first) == first and calls == []
    (root / "ant" / "0.jpg").touch()  # a changed file: every header read again
    os.utime(root / "ant" / "0.jpg", ns=(1, 1))
    data.describe(cfg, first)
    assert len(calls) == 10


def test_a_streaming_worker_meeting_a_broken_image_stops_the_run_naming_it_without_a_traceback(tmp_path):
    root = tmp_path / "imgs"
    _mixed_folder(root, per_class=10)
    cfg = DataConfig(source="folder", path=str(root), image_size=12, test_size=2)
    meta = data.prepare(cfg, 0, tmp_path / "f", tmp_path / "raw", form="files")
    listed = data.load_prepared(tmp_path / "f", "cpu", stream=True)
    images, labels = listed["train"]
    victim = root / images.paths[5]
    victim.write_bytes(b"overwritten")  # changed on disk after the data stage read it
    feed = stream.StreamBatches(images, labels, 4, meta["mean"], meta["std"], augment=True, shuffle=False,
                              channels_last=True, device="cpu", workers=2)
    with pytest.raises(DataError) as err:
        list(feed.epoch(0))
    msg = str(err.value)
    assert str(victim) in msg and "changed on disk during training" in msg
    assert "Traceback" not in msg and "DataLoader worker" not in msg  # not the wrapped exception of a worker


def test_env_check_streams_a_folder_as_a_file_list_and_checks_shared_memory(tmp_path, monkeypatch):
    root = tmp_path / "imgs"
    _mixed_folder(root, per_class=6)
    params = {"device": "cpu", "mlflow": {"enabled": False}, "model": {"arch": "small_cnn"},
              "data": {"source": "folder", "path": str(root), "image_size": 12, "placement": "auto", "workers": 2},
              "train": {"batch_size": 8, "eval_batch_size": 8}, "variants": {"fp32": {"precision": "fp32"}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    r = tmp_path / "reports"
    cmd = [sys.executable, "stages/env_check.py", "--params", str(tmp_path / "params.yaml"), "--env",
           str(r / "env.json"), "--plans", str(r / "plans"), "--data-source", str(r / "data_source.json"),
           "--model-source", str(r / "model_source.json"), "--roofline", str(r / "roofline.json")]
    run = dict(capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    out = subprocess.run(cmd, **run, env={**os.environ, env.MEMORY_CAP_ENV: "1000"})
    assert out.returncode == 0, out.stderr
    assert "data placement stream" in out.stdout
    assert "ant/notes.txt" in out.stdout and "bee/fake.jpg" in out.stdout  # named in env_check's warnings
    source = json.loads((r / "data_source.json").read_text())
    assert source["data"]["form"] == "files" and source["data"]["bad_files"] == "skip"
    prepared = subprocess.run([sys.executable, "stages/data.py", "--params", str(tmp_path / "params.yaml"), "--out",
                               str(tmp_path / "p"), "--raw", str(tmp_path / "raw"), "--data-source",
                               str(r / "data_source.json")], **run)
    assert prepared.returncode == 0, prepared.stderr
    assert "bee/cut.jpg" in prepared.stdout and "listed for streaming" in prepared.stdout
    assert json.loads((tmp_path / "p" / "meta.json").read_text())["form"] == "files"
    out = subprocess.run(cmd, **run)  # the set fits: the folder is decoded into tensors as before
    assert out.returncode == 0 and "data placement device" in out.stdout
    assert "form" not in json.loads((r / "data_source.json").read_text())["data"]


def test_streaming_stops_when_the_batches_in_flight_do_not_fit_in_shared_memory(tmp_path, monkeypatch):
    (tmp_path / "shm").mkdir()
    free = {"free": 64 * 2**20}
    monkeypatch.setattr(env.placement.shutil, "disk_usage", lambda p: type("U", (), free)())
    batch = 256 * 3 * 224 * 224  # 36.8 MiB of uint8 crops
    assert env.check_shared_memory(0, 2, batch, 1, str(tmp_path / "shm")) is None  # no workers: no shared memory
    with pytest.raises(EnvironmentMismatch) as err:
        env.check_shared_memory(4, 2, batch, 1, str(tmp_path / "shm"))
    msg = str(err.value)
    assert "1 process(es) x (4 worker(s) x 2 batches in flight + 1)" in msg and "64 MiB free" in msg
    assert "--shm-size=1024m" in msg and "data.workers" in msg
    free["free"] = 400 * 2**20
    assert "more than half" in env.check_shared_memory(4, 2, batch, 1, str(tmp_path / "shm"))
    free["free"] = 4000 * 2**20
    assert env.check_shared_memory(4, 2, batch, 1, str(tmp_path / "shm")) is None
    assert env.check_shared_memory(4, 2, batch, 1, str(tmp_path / "absent")) is None  # no /dev/shm here


def _jpeg_folder(root: Path, n: int, classes: int = 4, side: int = 16, seed: int = 0) -> None:
    """``n`` small JPEGs whose class shows in their colour, so a few steps learn something."""
    rng = np.random.default_rng(seed)
    tint = rng.integers(40, 216, (classes, 3))
    for i in range(n):
        c = i % classes
        (root / f"c{c}").mkdir(parents=True, exist_ok=True)
        px = np.clip(tint[c] + rng.normal(0, 40, (side, side, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(px).save(root / f"c{c}" / f"{i:05d}.jpg", quality=85)


@pytest.mark.slow
def test_a_jpeg_folder_too_large_for_the_device_streams_through_dvc_repro_with_adamw_and_clipping(tmp_path):
    """2,000 JPEGs, a device memory cap that makes auto stream, AdamW with clipping, and a decode slowed by the
    test hook: the pipeline lists the folder instead of storing it, trains from the files and calls the step
    input-bound."""
    from ampbench import sandbox
    from tests.conftest import SHRINK
    _jpeg_folder(tmp_path / "jpegs", 2000)
    params = sandbox.merge(copy.deepcopy(yaml.safe_load((REPO_ROOT / "params.yaml").read_text())), SHRINK)
    params = sandbox.merge(params, {
        "data": {"source": "folder", "path": str(tmp_path / "jpegs"), "image_size": 16, "train_size": 256,
                 "test_size": 64, "placement": "auto", "workers": 1},
        "train": {"epochs": 2, "batch_size": 32, "optimizer": "adamw", "lr": 0.003, "weight_decay": 0.05,
                  "clip_grad_norm": 1.0, "augment": True},
        "amp": {"audit_batches": 0}, "profile": {"steps": 0}, "sweep": {"enabled": False},
        "mlflow": {"enabled": False}})
    params["variants"] = {"fp32": {"precision": "fp32"}, "bf16": {"precision": "bf16"}}
    repo = sandbox.create(tmp_path / "repo", params)
    run_env = {**sandbox.env_with_venv(), env.MEMORY_CAP_ENV: str(2**20), data.folder.DECODE_DELAY_ENV: "3"}
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=run_env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "data placement stream (auto:" in proc.stdout and "listed for streaming" in proc.stdout
    prepared = repo / "data" / "prepared"
    assert sorted(p.name for p in prepared.iterdir()) == ["files.json", "meta.json"]  # not decoded a second time
    assert sum(f.stat().st_size for f in prepared.iterdir()) < 100_000
    r = repo / "reports"
    for name in ("fp32", "bf16"):
        m = json.loads((r / "runs" / name / "metrics.json").read_text())
        assert m["data_placement"] == "stream" and m["data_workers"] == 1 and m["optimizer"] == "adamw"
        assert m["clip_grad_norm"] == 1.0 and m["final_acc"] > 0.25  # 4 classes: chance is 25%
        assert m["data_time_fraction"] > 0.1
    norms = (r / "runs" / "fp32" / "grad_norm.csv").read_text().splitlines()
    assert len(norms) > 2
    md = (r / "report.md").read_text()
    assert "Input-bound: the CPU waited" in md and "raise data.workers (1 now)" in md and "bf16 (BF16-AMP)" in md
    assert config.load(repo / "params.yaml").data.placement == "auto"


def test_the_held_out_split_holds_when_files_come_and_go_and_too_few_images_stop_early(tmp_path):
    root = tmp_path / "imgs"
    _mixed_folder(root, per_class=15)
    (root / "ant" / ".thumbnails").mkdir()
    Image.new("RGB", (8, 8)).save(root / "ant" / ".thumbnails" / "0.jpg")  # inside a hidden folder: not data
    cfg = DataConfig(source="folder", path=str(root), image_size=12, test_size=6)

    def split():
        found = data.folder.verify(cfg, 0, keep=False)["splits"]
        return {s: {p.relative_to(root).as_posix() for p, _ in found[s][0]} for s in ("train", "test")}
    before = split()
    assert len(before["test"]) == 6 and not any(".thumbnails" in p for s in before.values() for p in s)
    Image.new("RGB", (8, 8), "red").save(root / "bee" / "new.png")  # one more image
    after = split()
    assert len(after["test"]) == 6 and len(before["test"] - after["test"]) <= 1  # at most one image moved
    other = {p.relative_to(root).as_posix() for p, _ in data.folder.verify(cfg, 1, keep=False)["splits"]["test"][0]}
    assert len(other) == 6 and other != after["test"]  # another seed, another split
    few = tmp_path / "few"
    for c in ("a", "b"):
        (few / c).mkdir(parents=True)
        (few / c / "x.jpg").write_bytes(b"not a jpeg")
    Image.new("RGB", (8, 8)).save(few / "a" / "ok.png")
    with pytest.raises(DataError, match="has 1 readable image"):  # env_check stops, not the data stage later
        data.describe(DataConfig(source="folder", path=str(few)))
