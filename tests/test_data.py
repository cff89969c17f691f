"""Data: the real CIFAR-10 path (loopback HTTP, file://, local archive), checksums, synthetic data, batches."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ampbench import config, data
from ampbench.config import DataConfig
from ampbench.data import batches as feeds
from ampbench.errors import ConfigError, DataError, EnvironmentMismatch
from tests.conftest import make_cifar_archive


@pytest.fixture
def archive(tmp_path):
    return make_cifar_archive(tmp_path / "served")


@contextlib.contextmanager
def serve(directory: Path):
    """A loopback HTTP server for ``directory``; yields (base URL, the paths it served)."""
    hits = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.headers.get("Method") == "HEAD":  # torchvision's redirect probe: headers only
                self.do_HEAD()
                return
            hits.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass  # the redirect probe hangs up mid-transfer

    httpd = Server(("127.0.0.1", 0), functools.partial(Handler, directory=str(directory)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", hits
    finally:
        httpd.shutdown()


@pytest.fixture
def server(archive):
    """A loopback HTTP server for the archive's folder; counts the requests it serves."""
    with serve(archive[0].parent) as served:
        yield served


def _check_prepared(out: Path, arrays: dict, meta: dict):
    blob = torch.load(out / "train.pt", weights_only=True)
    expected = torch.cat([torch.as_tensor(arrays[f"data_batch_{i}"][0]) for i in range(1, 6)]).reshape(-1, 3, 32, 32)
    assert blob["images"].dtype == torch.uint8 and torch.equal(blob["images"], expected)
    labels = sum((arrays[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    assert blob["labels"].tolist() == labels
    test = torch.load(out / "test.pt", weights_only=True)
    assert test["labels"].tolist() == arrays["test_batch"][1]
    assert meta["train_count"] == 30 and meta["test_count"] == 8


def test_download_from_loopback_mirror(tmp_path, archive, server):
    _, md5, arrays = archive
    base, hits = server
    cfg = DataConfig(source="cifar10", url=f"{base}/cifar-10-python.tar.gz", md5=md5)
    meta = data.prepare(cfg, 0, tmp_path / "prepared", tmp_path / "raw")
    _check_prepared(tmp_path / "prepared", arrays, meta)
    assert hits == ["/cifar-10-python.tar.gz"]
    data.prepare(cfg, 0, tmp_path / "prepared", tmp_path / "raw")  # verified copy in the cache: no new download
    assert len(hits) == 1


def test_file_url_and_local_archive(tmp_path, archive):
    path, md5, arrays = archive
    meta = data.prepare(DataConfig(url=path.as_uri(), md5=md5), 0, tmp_path / "a", tmp_path / "raw")
    _check_prepared(tmp_path / "a", arrays, meta)
    meta = data.prepare(DataConfig(archive=str(path), md5=md5), 0, tmp_path / "b", tmp_path / "raw2")
    _check_prepared(tmp_path / "b", arrays, meta)
    assert not (tmp_path / "raw2" / data.ARCHIVE_NAME).exists()  # a local archive is read in place


def test_corrupted_download_is_retried_once_then_fails_cleanly(tmp_path, archive, server):
    path, md5, _ = archive
    base, hits = server
    path.write_bytes(path.read_bytes()[:-100])  # cut short on the server
    out = tmp_path / "prepared"
    cfg = DataConfig(url=f"{base}/cifar-10-python.tar.gz", md5=md5)
    with pytest.raises(DataError, match="could not fetch a verified CIFAR-10 archive"):
        data.prepare(cfg, 0, out, tmp_path / "raw")
    assert len(hits) == 2
    assert not out.exists() and not (tmp_path / "raw" / data.ARCHIVE_NAME).exists()
    assert list(tmp_path.glob(".prepared*")) == []


def test_corrupted_local_archive_fails_its_checksum(tmp_path, archive):
    path, md5, _ = archive
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"\x00" + path.read_bytes()[1:])
    with pytest.raises(DataError, match="fails its MD5 check"):
        data.prepare(DataConfig(archive=str(bad), md5=md5), 0, tmp_path / "prepared", tmp_path / "raw")
    assert not (tmp_path / "prepared").exists()


def test_a_sha256_given_is_checked_beside_the_md5_downloaded_or_local(tmp_path, archive, server):
    """MD5 catches corruption; a SHA-256 (data.sha256) also rules out an archive made to match the MD5."""
    import hashlib
    (path, md5, arrays), (base, hits) = archive, server
    cfg = DataConfig(url=f"{base}/cifar-10-python.tar.gz", md5=md5,
                     sha256=hashlib.sha256(path.read_bytes()).hexdigest().upper())
    _check_prepared(tmp_path / "a", arrays, data.prepare(cfg, 0, tmp_path / "a", tmp_path / "raw"))
    other = "0" * 64  # the MD5 still matches: only the SHA-256 tells
    with pytest.raises(DataError, match=f"fails its SHA-256 check \\(expected data.sha256 = {other}\\)"):
        data.prepare(DataConfig(archive=str(path), md5=md5, sha256=other), 0, tmp_path / "b", tmp_path / "raw2")
    with pytest.raises(DataError, match="could not fetch a verified"):  # a download that fails it: fetched again
        data.prepare(DataConfig(url=cfg.url, md5=md5, sha256=other), 0, tmp_path / "c", tmp_path / "raw3")
    assert len(hits) == 3 and not (tmp_path / "raw3" / data.ARCHIVE_NAME).exists()
    with pytest.raises(ConfigError, match="data.sha256 = 'abc' is not a SHA-256 checksum"):
        data.prepare(DataConfig(archive=str(path), md5=md5, sha256="abc"), 0, tmp_path / "d", tmp_path / "raw4")
    assert not any((tmp_path / d).exists() for d in "bcd")  # nothing half-made


def test_failed_prepare_keeps_the_previous_set(tmp_path, archive):
    path, md5, _ = archive
    out = tmp_path / "prepared"
    data.prepare(DataConfig(source="synthetic", train_size=16, test_size=8), 0, out, tmp_path / "raw")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(DataError):
        data.prepare(DataConfig(archive=str(path), md5="0" * 32), 0, out, tmp_path / "raw")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_subset_sizes(tmp_path, archive):
    path, md5, _ = archive
    meta = data.prepare(DataConfig(archive=str(path), md5=md5, train_size=10, test_size=4), 0,
                        tmp_path / "p", tmp_path / "raw")
    assert (meta["train_count"], meta["test_count"]) == (10, 4)


def test_synthetic_is_deterministic_and_learnable_shape():
    x1, y1 = data.synthetic(64, seed=0, split_seed=1)
    x2, y2 = data.synthetic(64, seed=0, split_seed=1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (64, 3, 32, 32) and x1.dtype == torch.uint8
    assert int(y1.min()) >= 0 and int(y1.max()) < 10
    x3, _ = data.synthetic(64, seed=0, split_seed=2)
    assert not torch.equal(x1, x3)
    # class signal: images of one class are closer to their class mean than to another class's mean
    x, y = data.synthetic(2000, seed=0, split_seed=3)
    means = torch.stack([x[y == c].float().mean(0) for c in range(10)])
    d = torch.cdist(x.float().flatten(1), means.flatten(1))
    assert (d.argmin(1) == y).float().mean() > 0.5


def test_damaged_prepared_set_is_refused(tmp_path):
    out = tmp_path / "p"
    data.prepare(DataConfig(source="synthetic", train_size=16, test_size=8), 0, out, tmp_path / "raw")
    blob = torch.load(out / "train.pt", weights_only=True)
    blob["labels"][0] = 12
    torch.save(blob, out / "train.pt")
    with pytest.raises(DataError, match="labels outside"):
        data.load_prepared(out, "cpu")
    with pytest.raises(DataError, match="run the data stage"):
        data.load_prepared(tmp_path / "nothing", "cpu")


def _raw_batches(images, pad, augment=True, seed=0):
    """DeviceBatches whose normalisation is the identity (mean 0, std 1/255): outputs are the raw pixels."""
    return feeds.DeviceBatches(images, torch.zeros(len(images), dtype=torch.int64), len(images), [0.0] * 3,
                              [1 / 255] * 3, augment=augment, shuffle=False, channels_last=True, seed=seed, pad=pad)


def test_crop_without_padding_is_identity_or_mirror():
    x = torch.randint(0, 255, (8, 3, 6, 6), dtype=torch.uint8)
    out, _ = next(_raw_batches(x, pad=0).epoch(0))
    for i in range(8):
        assert torch.equal(out[i], x[i].float()) or torch.equal(out[i], x[i].flip(-1).float())


def test_crop_shifts_within_padding():
    x = torch.full((64, 3, 8, 8), 7, dtype=torch.uint8)
    out, _ = next(_raw_batches(x, pad=2).epoch(0))
    zero_rows = (out == 0).all(dim=(1, 3)).sum(dim=1)  # padded rows that came into view
    assert int(zero_rows.max()) <= 2 and int(zero_rows.sum()) > 0
    assert set(out.unique().tolist()) == {0.0, 7.0}


def test_crop_moves_whole_pixels_and_eval_is_exact():
    x = torch.randint(0, 255, (16, 1, 8, 8), dtype=torch.uint8).expand(16, 3, 8, 8).contiguous()
    out, _ = next(_raw_batches(x, pad=2).epoch(0))
    assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 0], out[:, 2])  # channels not mixed
    plain, _ = next(_raw_batches(x, pad=4, augment=False).epoch(0))
    assert torch.equal(plain, x.float())


def test_device_batches_cover_the_set_and_replay_per_epoch():
    x, y = data.synthetic(70, 0, 1)
    b = feeds.DeviceBatches(x, y, 32, [0.5] * 3, [0.25] * 3, augment=True, shuffle=True, channels_last=True, seed=3)
    assert len(b) == 3
    batches = list(b.epoch(0))
    assert [len(yy) for _, yy in batches] == [32, 32, 6]
    assert sorted(torch.cat([yy for _, yy in batches]).tolist()) == sorted(y.tolist())
    assert batches[0][0].dtype == torch.float32
    assert batches[0][0].is_contiguous(memory_format=torch.channels_last)
    again = list(b.epoch(0))
    assert all(torch.equal(a[0], c[0]) for a, c in zip(batches, again, strict=True))
    assert not torch.equal(next(b.epoch(1))[0], batches[0][0])


def test_cifar100_downloads_through_the_same_path(tmp_path):
    path, md5, arrays = make_cifar_archive(tmp_path / "served100", per_batch=20, test_count=10, kind="cifar100")
    with serve(path.parent) as (base, hits):
        cfg = DataConfig(source="cifar100", url=f"{base}/{path.name}", md5=md5)
        meta = data.prepare(cfg, 0, tmp_path / "prepared", tmp_path / "raw")
    assert hits == [f"/{path.name}"]
    assert meta["source"] == "cifar100" and meta["num_classes"] == 100
    assert (meta["train_count"], meta["test_count"]) == (20, 10)
    train = torch.load(tmp_path / "prepared" / "train.pt", weights_only=True)
    assert train["labels"].tolist() == arrays["train"][1]  # the fine labels, not the coarse ones
    assert torch.equal(train["images"], torch.as_tensor(arrays["train"][0]).reshape(-1, 3, 32, 32))
    loaded = data.load_prepared(tmp_path / "prepared", "cpu")
    assert loaded["meta"]["num_classes"] == 100
    assert data.describe(cfg)["num_classes"] == 100


def test_cifar100_official_url_and_checksum_are_the_default():
    from ampbench.data import cifar
    cfg = DataConfig(source="cifar100")
    assert cifar.source_url(cfg).endswith("/cifar-100-python.tar.gz")
    assert cifar.source_md5(cfg) == "eb9058c3a382ffc7106e4002c42a8d85"
    assert cifar.source_url(DataConfig()).endswith("/cifar-10-python.tar.gz")


def test_every_data_source_params_yaml_accepts_is_registered_with_describe_and_read():
    assert tuple(data.SOURCES) == config.DATA_SOURCES
    for source in data.SOURCES.values():
        assert callable(source.describe) and callable(source.read) and isinstance(source.SUBSETS_TEST, bool)


def _png_folder(root: Path, classes: dict[str, int], size=(20, 12), seed=0) -> None:
    rng = np.random.default_rng(seed)
    for c, n in classes.items():
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(root / c / f"{i}.png")


def test_image_folder_is_decoded_resized_and_split(tmp_path):
    _png_folder(tmp_path / "imgs", {"cat": 6, "dog": 4, "emu": 5})
    (tmp_path / "imgs" / "cat" / "notes.txt").write_text("not an image")
    cfg = DataConfig(source="folder", path=str(tmp_path / "imgs"), image_size=16, test_size=3)
    desc = data.describe(cfg)
    assert (desc["num_classes"], desc["train_count"], desc["test_count"]) == (3, 12, 3)
    meta = data.prepare(cfg, 0, tmp_path / "p", tmp_path / "raw")
    assert meta["classes"] == ["cat", "dog", "emu"] and meta["num_classes"] == 3
    assert meta["image_shape"] == [3, 16, 16] and (meta["train_count"], meta["test_count"]) == (12, 3)
    loaded = data.load_prepared(tmp_path / "p", "cpu")
    labels = torch.cat([loaded["train"][1], loaded["test"][1]])
    assert sorted(labels.tolist()) == [0] * 6 + [1] * 4 + [2] * 5
    one = Image.open(tmp_path / "imgs" / "dog" / "0.png").convert("RGB").resize((16, 16), Image.Resampling.BILINEAR)
    want = torch.as_tensor(np.array(one)).permute(2, 0, 1)
    assert any(torch.equal(want, x) for x in torch.cat([loaded["train"][0], loaded["test"][0]]))
    again = data.describe(cfg)["files_sha256"]
    _png_folder(tmp_path / "imgs", {"dog": 5}, seed=1)  # one more image: the fingerprint changes
    assert data.describe(cfg)["files_sha256"] != again


def test_image_folder_with_its_own_splits(tmp_path):
    _png_folder(tmp_path / "imgs" / "train", {"a": 3, "b": 3})
    _png_folder(tmp_path / "imgs" / "val", {"a": 1, "b": 2})
    meta = data.prepare(DataConfig(source="folder", path=str(tmp_path / "imgs")), 0, tmp_path / "p", tmp_path / "r")
    assert (meta["train_count"], meta["test_count"], meta["image_shape"]) == (6, 3, [3, 32, 32])


@pytest.mark.parametrize(("make", "words"), [
    (lambda root: root.mkdir(), "no class subfolders"),
    (lambda root: (root / "a").mkdir(parents=True), "holds no images"),
    (lambda root: _png_folder(root, {"only": 3}), "has one class (only)"),
])
def test_image_folder_errors(tmp_path, make, words):
    root = tmp_path / "imgs"
    make(root)
    with pytest.raises(DataError, match=re.escape(words)):
        data.describe(DataConfig(source="folder", path=str(root)))


def test_a_data_set_too_large_for_the_device_stops_before_training():
    from ampbench import env
    desc = {"image_size": 224, "train_count": 1_300_000, "test_count": 50_000}
    info = {"gpu": {"name": "NVIDIA L4", "total_memory_bytes": 24 * 2**30}}
    with pytest.raises(EnvironmentMismatch, match=r"about 202\.5 GiB .* lower data.image_size or data.train_size"):
        env.check_fits(data.resident_bytes(desc), desc, "cuda", info)
    env.check_fits(data.resident_bytes({**desc, "image_size": 32, "train_count": 50_000}), desc, "cuda", info)


def test_device_batches_resize_for_a_larger_model_input():
    x, y = data.synthetic(8, 0, 1)
    b = feeds.DeviceBatches(x, y, 8, [0.5] * 3, [0.25] * 3, augment=True, shuffle=True, channels_last=True,
                           out_size=64)
    out, _ = next(b.epoch(0))
    assert out.shape == (8, 3, 64, 64) and out.is_contiguous(memory_format=torch.channels_last)


def test_an_archive_is_extracted_with_the_data_filter_and_unpickled_admitting_only_what_a_batch_holds(tmp_path):
    """A mirror's or a local archive is trusted no further than its checksum (which the user may give): a member
    outside the folder stops the extraction, and a batch whose pickle would call anything but numpy's array
    constructors is refused unread."""
    import io
    import pickle
    import tarfile

    from ampbench.data import cifar
    from ampbench.errors import DataError

    def archive(name: str, members: dict[str, bytes]) -> Path:
        path = tmp_path / name
        with tarfile.open(path, "w:gz") as tar:
            for member, blob in members.items():
                info = tarfile.TarInfo(member)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
        return path

    with pytest.raises(DataError, match=r"archive .*outside.tar.gz is refused: .*'../../escaped'.* official"):
        cifar.read_archive("cifar10", archive("outside.tar.gz", {"../../escaped": b"x"}), tmp_path / "w1")
    assert not (tmp_path / "escaped").exists()

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))
    batch = pickle.dumps({b"data": Payload(), b"labels": [0]}, protocol=2)
    members = {f"cifar-10-batches-py/{n}": batch for n in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]}
    with pytest.raises(DataError, match=r"data_batch_1 is not a CIFAR batch \(it holds posix.system, which no CIFAR "
                                        r"batch does\); refused unread"):
        cifar.read_archive("cifar10", archive("payload.tar.gz", members), tmp_path / "w2")
    assert not (tmp_path / "ran").exists()
