"""Data: CIFAR-10, CIFAR-100, an image folder or a synthetic set, written once as uint8 tensors.

Each source is a module of this package, registered in ``SOURCES`` with the same ``describe`` and ``read``:
a new source is one module and one line there (and its name in ``config.DATA_SOURCES``).
Downloading and checksumming use torchvision's own code (progress bar, MD5).
The prepared set is ``train.pt`` / ``test.pt`` (uint8 images N x 3 x H x W,
int64 labels) plus ``meta.json`` (counts, classes, image shape, mean and std),
written to a temporary folder and renamed, so a later stage never reads a
half-written set. ``DeviceBatches`` keeps the whole set on the training device
and augments there (random crop with padding, flip); ``StreamBatches`` (``data.placement: stream``) leaves it
memory-mapped in host memory and streams each batch to the device through DataLoader workers.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from ampbench.config import DataConfig
from ampbench.data import cifar, folder
from ampbench.data import synthetic as synthetic_source
from ampbench.data.batches import Batches, DeviceBatches
from ampbench.data.cifar import ARCHIVE_NAME
from ampbench.data.stream import StreamBatches
from ampbench.data.synthetic import NUM_CLASSES as SYNTHETIC_CLASSES
from ampbench.data.synthetic import splits as synthetic_splits
from ampbench.data.synthetic import synthetic
from ampbench.errors import DataError

__all__ = ["ARCHIVE_NAME", "Batches", "DeviceBatches", "StreamBatches", "describe", "load_prepared", "prepare",
           "resident_bytes", "synthetic", "synthetic_in_memory", "synthetic_splits"]

PAD = 4  # the augmentation's crop padding, stored with the set on the device
# The sources, by data.source: each module has describe(cfg) -> dict, read(cfg, seed, raw_dir) -> (splits,
# origin, classes) and SUBSETS_TEST (whether data.test_size takes a subset of its test split).
SOURCES = {"cifar10": cifar, "cifar100": cifar, "folder": folder, "synthetic": synthetic_source}


def describe(cfg: DataConfig) -> dict:
    """Classes, image side and image counts of the set ``cfg`` makes, known without preparing it (a folder's
    also a fingerprint of its files); a source's bad params.yaml value (a missing archive or folder) stops here."""
    source = SOURCES[cfg.source]
    desc = source.describe(cfg)
    if cfg.train_size:
        desc["train_count"] = min(desc["train_count"], cfg.train_size)
    if cfg.test_size and source.SUBSETS_TEST:
        desc["test_count"] = min(desc["test_count"], cfg.test_size)
    return desc


def resident_bytes(desc: dict, augment: bool = True) -> int:
    """Bytes the set takes on the device: uint8 pixels (training images padded for the crop) and int64 labels."""
    s, p = desc["image_size"], PAD if augment else 0
    return 3 * (desc["train_count"] * (s + 2 * p) ** 2 + desc["test_count"] * s * s) \
        + 8 * (desc["train_count"] + desc["test_count"])


def _subset(images: torch.Tensor, labels: torch.Tensor, size: int, seed: int):
    if size == 0 or size >= len(labels):
        return images, labels
    idx = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))[:size]
    idx = idx.sort().values
    return images[idx].contiguous(), labels[idx].contiguous()


def prepare(cfg: DataConfig, seed: int, out_dir: Path, raw_dir: Path) -> dict:
    """Make the prepared set in ``out_dir`` (atomically) and return its metadata."""
    source = SOURCES[cfg.source]
    full, origin, num_classes = source.read(cfg, seed, Path(raw_dir))
    test = _subset(*full["test"], cfg.test_size, seed + 1) if source.SUBSETS_TEST else full["test"]
    splits = {"train": _subset(*full["train"], cfg.train_size, seed), "test": test}
    meta = {
        **origin,
        "train_count": len(splits["train"][1]),
        "test_count": len(splits["test"][1]),
        "num_classes": num_classes,
        "image_shape": list(splits["train"][0].shape[1:]),
        **_stats(splits["train"][0]),
    }
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for split, (x, y) in splits.items():
            torch.save({"images": x, "labels": y}, tmp / f"{split}.pt")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return meta


def _stats(images: torch.Tensor) -> dict:
    x = images.float() / 255
    return {"mean": [round(v, 6) for v in x.mean(dim=(0, 2, 3)).tolist()],
            "std": [round(v, 6) for v in x.std(dim=(0, 2, 3)).tolist()]}


def synthetic_in_memory(n_train: int, n_test: int, seed: int, device: str | torch.device) -> dict:
    """The synthetic set built in memory, in ``load_prepared``'s form (for benchmarks: no files)."""
    splits = synthetic_splits(n_train, n_test, seed)
    meta = {"source": "synthetic", "seed": seed, "train_count": n_train, "test_count": n_test,
            "num_classes": SYNTHETIC_CLASSES,
            "image_shape": [3, 32, 32], **_stats(splits["train"][0])}
    return {"meta": meta, **{k: tuple(t.to(device) for t in v) for k, v in splits.items()}}


def load_prepared(folder_: Path, device: str | torch.device, stream: bool = False) -> dict:
    """Load and check a prepared set, moving it onto ``device`` once; with ``stream``, memory-mapped and left in
    host memory (read image by image as batches are drawn)."""
    folder_ = Path(folder_)
    meta_path = folder_ / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"{folder_} holds no prepared data set; run the data stage first (dvc repro data)")
    meta = json.loads(meta_path.read_text())
    meta.setdefault("num_classes", 10)  # sets prepared before the class count was recorded were CIFAR-10 shaped
    meta.setdefault("image_shape", [3, 32, 32])
    shape, classes = tuple(meta["image_shape"]), meta["num_classes"]
    out = {"meta": meta}
    for split in ("train", "test"):
        blob = torch.load(folder_ / f"{split}.pt", map_location="cpu", weights_only=True, mmap=stream)
        x, y = blob["images"], blob["labels"]
        count = meta[f"{split}_count"]
        problem = None
        if x.dtype != torch.uint8 or tuple(x.shape[1:]) != shape:
            problem = f"images are {x.dtype} {tuple(x.shape)}, expected uint8 N x {' x '.join(map(str, shape))}"
        elif len(x) != count or len(y) != count:
            problem = f"{len(x)} images and {len(y)} labels, expected {count}"
        elif count and (int(y.min()) < 0 or int(y.max()) >= classes):
            problem = f"labels outside 0..{classes - 1}"
        if problem:
            raise DataError(f"{folder_}/{split}.pt is damaged ({problem}); rerun the data stage "
                            "(dvc repro -f data)")
        out[split] = (x, y) if stream else (x.to(device), y.to(device))
    return out
