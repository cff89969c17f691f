"""CIFAR-10 and CIFAR-100, a data source: fetch and verify the official archive (torchvision's downloader, the
archives' URLs and MD5s below), read its pickled batches.

An archive from a mirror or a local file is not trusted further than its checksum: it is extracted with tarfile's
``data`` filter (no member outside the folder, no link out of it, no device files) and its batches are unpickled
admitting only what CIFAR's batches hold (dicts, lists, bytes and numpy arrays), never a class or a function that
running the pickle would call.

    describe(cfg) -> classes, image side, counts       read(cfg, seed, raw_dir) -> splits, origin, classes
"""

from __future__ import annotations

import hashlib
import pickle
import re
import shutil
import tarfile
import tempfile
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import torch

from ampbench.config import DataConfig, path_is
from ampbench.errors import ConfigError, DataError


@dataclass(frozen=True)
class CifarFormat:
    label: str              # for messages
    archive: str            # the archive's file name
    folder: str             # the folder inside it
    train: tuple[str, ...]  # pickled batches of the training split
    test: tuple[str, ...]
    labels_key: str         # CIFAR-100 has fine (100) and coarse (20) labels; we train on the fine ones
    num_classes: int
    url: str                # the official archive
    md5: str                # its checksum


FORMATS = {
    "cifar10": CifarFormat("CIFAR-10", "cifar-10-python.tar.gz", "cifar-10-batches-py",
                           tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), "labels", 10,
                           "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                           "c58f30108f718f92721af3b95e74349a"),
    "cifar100": CifarFormat("CIFAR-100", "cifar-100-python.tar.gz", "cifar-100-python", ("train",), ("test",),
                            "fine_labels", 100, "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
                            "eb9058c3a382ffc7106e4002c42a8d85"),
}
IMAGE_SHAPE = (3, 32, 32)
ARCHIVE_NAME = FORMATS["cifar10"].archive
COUNTS = (50_000, 10_000)  # train and test images in either archive
SUBSETS_TEST = True        # data.test_size takes a subset of the test split


def source_url(cfg: DataConfig) -> str:
    """The URL the archive of ``cfg.source`` is fetched from: data.url, else the official one."""
    return cfg.url or FORMATS[cfg.source].url


def source_md5(cfg: DataConfig) -> str:
    """The checksum the archive must have: data.md5, else the official archive's."""
    return cfg.md5 or FORMATS[cfg.source].md5


def describe(cfg: DataConfig) -> dict:
    """Classes, image side and counts of the full archive; a data.archive that is not there is refused."""
    if cfg.sha256 and not re.fullmatch(r"[0-9a-fA-F]{64}", cfg.sha256):
        raise ConfigError(f"params.yaml: data.sha256 = {cfg.sha256!r} is not a SHA-256 checksum (64 hex digits); "
                          "give the archive's `sha256sum`, or set it to \"\"")
    if cfg.archive and not path_is(cfg.archive, "file"):
        raise ConfigError(f"params.yaml: data.archive = {cfg.archive!r}: no such file; give the path of a local "
                          "copy of the archive, or set it to \"\" to download it")
    train, test = COUNTS
    return {"num_classes": FORMATS[cfg.source].num_classes, "image_size": IMAGE_SHAPE[-1], "train_count": train,
            "test_count": test}


def read(cfg: DataConfig, seed: int, raw_dir: Path) -> tuple[dict, dict, int]:
    """The full splits from the verified archive, where they came from, and the class count."""
    describe(cfg)
    archive = fetch(cfg, raw_dir)
    fmt = FORMATS[cfg.source]
    origin = {"source": cfg.source, "md5": source_md5(cfg), **({"sha256": cfg.sha256.lower()} if cfg.sha256 else {})}
    return read_archive(cfg.source, archive, raw_dir), origin, fmt.num_classes


def fetch(cfg: DataConfig, raw_dir: Path) -> Path:
    """Return the path of a verified archive of ``cfg.source``: the local archive, or a download.

    A download that fails its checksum is deleted and fetched once more.
    """
    from torchvision.datasets.utils import check_integrity, download_url  # a CIFAR run alone pays torchvision's import

    fmt, url, md5 = FORMATS[cfg.source], source_url(cfg), source_md5(cfg)

    def verified(path: Path) -> str:
        """"" when the file has its checksums; else which one it fails."""
        if not check_integrity(str(path), md5):
            return f"MD5 check (expected {md5})"
        if cfg.sha256 and _sha256(path) != cfg.sha256.lower():
            return f"SHA-256 check (expected data.sha256 = {cfg.sha256.lower()})"
        return ""

    if cfg.archive:
        path = Path(cfg.archive)
        failed = verified(path)
        if failed:
            raise DataError(f"data.archive = {cfg.archive!r} fails its {failed}; "
                            f"the file is corrupted or not {fmt.archive}: download it again")
        return path
    raw_dir.mkdir(parents=True, exist_ok=True)
    path = raw_dir / fmt.archive
    last_error: Exception | None = None
    for attempt in (1, 2):
        if path.exists():
            if not verified(path):
                print(f"using the verified archive already in {path}", flush=True)
                return path
            path.unlink()  # a cut-short or corrupted earlier download
        try:
            print(f"downloading {url} (attempt {attempt} of 2)", flush=True)
            if url.startswith("file:"):  # torchvision's downloader needs an HTTP response length
                shutil.copyfile(url2pathname(urlparse(url).path), path)
            else:
                download_url(url, str(raw_dir), fmt.archive, md5)  # progress bar, MD5 check
            failed = verified(path)
            if failed:
                raise RuntimeError(f"the download fails its {failed}")
            return path
        except (urllib.error.URLError, OSError, RuntimeError, ValueError) as err:
            last_error = err
            print(f"download failed: {err}", flush=True)
    if path.exists():
        path.unlink()
    raise DataError(f"could not fetch a verified {fmt.label} archive from data.url = {url!r} "
                    f"({last_error}); check the URL or the network, or set data.archive to a local {fmt.archive}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# what unpickling a CIFAR batch may construct: numpy's arrays (Python 2's cPickle and numpy 1 or 2 name them so),
# and bytes as Python 3 writes them at protocol 2 (codecs.encode of a latin-1 string)
_BATCH_GLOBALS = {("_codecs", "encode"), ("numpy.core.multiarray", "_reconstruct"),
                  ("numpy._core.multiarray", "_reconstruct"),
                  ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                  ("numpy._core.multiarray", "scalar")}


class _BatchUnpickler(pickle.Unpickler):
    """An unpickler that admits CIFAR's batches and refuses anything else a pickle could run."""

    def find_class(self, module: str, name: str):
        if (module, name) in _BATCH_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it holds {module}.{name}, which no CIFAR batch does")


def _unpickle(path: Path, fmt: CifarFormat):
    try:
        with open(path, "rb") as f:
            return _BatchUnpickler(f, encoding="bytes").load()
    except pickle.UnpicklingError as err:
        raise DataError(f"the {fmt.label} archive's {path.name} is not a CIFAR batch ({err}); refused unread: use "
                        f"the official {fmt.archive}") from None


def _extract(archive: Path, dest: str, fmt: CifarFormat) -> None:
    """Extract with tarfile's ``data`` filter: a member outside ``dest``, a link out of it or a device file stops."""
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
    except tarfile.FilterError as err:
        raise DataError(f"the {fmt.label} archive {archive} is refused: {err}; use the official {fmt.archive}") \
            from None
    except (tarfile.TarError, EOFError, OSError) as err:
        why = (str(err).splitlines() or [""])[0].rstrip(":")  # tarfile's "could not be opened" lists each method tried
        raise DataError(f"the {fmt.label} archive {archive} cannot be extracted ({type(err).__name__}: {why}); it is "
                        f"not {fmt.archive}") from None


def _read_batches(fmt: CifarFormat, folder: Path, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = [], []
    key = fmt.labels_key.encode()
    for name in names:
        path = folder / name
        if not path.is_file():
            raise DataError(f"the {fmt.label} archive has no {fmt.folder}/{name}; it is not {fmt.archive}")
        batch = _unpickle(path, fmt)
        data = batch[b"data"] if b"data" in batch else batch["data"]
        labs = batch[key] if key in batch else batch[fmt.labels_key]
        images.append(torch.as_tensor(data, dtype=torch.uint8).reshape(-1, *IMAGE_SHAPE))
        labels.append(torch.as_tensor(labs, dtype=torch.int64))
    return torch.cat(images), torch.cat(labels)


def read_archive(source: str, archive: Path, workdir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Extract the archive to a scratch folder and read its train and test batches."""
    fmt = FORMATS[source]
    workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        _extract(archive, tmp, fmt)
        folder = Path(tmp) / fmt.folder
        return {"train": _read_batches(fmt, folder, fmt.train), "test": _read_batches(fmt, folder, fmt.test)}
