"""Data: CIFAR-10, CIFAR-100, an image folder or a synthetic set, written once as uint8 tensors.

Downloading and checksumming use torchvision's own code (progress bar, MD5).
The prepared set is ``train.pt`` / ``test.pt`` (uint8 images N x 3 x H x W,
int64 labels) plus ``meta.json`` (counts, classes, image shape, mean and std),
written to a temporary folder and renamed, so a later stage never reads a
half-written set. ``DeviceBatches`` keeps the whole set on the training device
and augments there (random crop with padding, flip).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch

from ampbench.config import DataConfig, source_md5
from ampbench.data import cifar, folder
from ampbench.data.batches import DeviceBatches
from ampbench.data.cifar import ARCHIVE_NAME
from ampbench.data.synthetic import NUM_CLASSES as SYNTHETIC_CLASSES
from ampbench.data.synthetic import splits as synthetic_splits
from ampbench.data.synthetic import synthetic
from ampbench.errors import DataError

__all__ = ["ARCHIVE_NAME", "DeviceBatches", "describe", "load_prepared", "prepare", "resident_bytes", "synthetic",
           "synthetic_in_memory", "synthetic_splits"]

PAD = 4  # the augmentation's crop padding, stored with the set on the device
_SIZES = {"cifar10": (50_000, 10_000), "cifar100": (50_000, 10_000), "synthetic": (50_000, 10_000)}


def describe(cfg: DataConfig) -> dict:
    """Classes, image side and image counts of the set ``cfg`` makes, known without preparing it.

    For a folder also a fingerprint of its files (names, sizes, modification times), so the data
    stage reruns when an image is added, removed or changed.
    """
    extra: dict = {}
    if cfg.source == "folder":
        found = folder.scan(cfg)
        h = hashlib.sha256()
        for path, label in found["files"]["train"] + found["files"].get("test", []):
            st = path.stat()
            h.update(f"{path.relative_to(cfg.path)}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        extra = {"classes": found["classes"], "files_sha256": h.hexdigest()}
        if found["split"]:
            n_train, n_test = len(found["files"]["train"]), len(found["files"]["test"])
        else:
            total = len(found["files"]["train"])
            n_test = folder.held_out_count(total, cfg.test_size)
            n_train = total - n_test
        classes, side = len(found["classes"]), cfg.image_size
    else:
        n_train, n_test = _SIZES[cfg.source]
        classes = cifar.FORMATS[cfg.source].num_classes if cfg.source in cifar.FORMATS else SYNTHETIC_CLASSES
        side = 32
        if cfg.source == "synthetic":
            n_train, n_test = cfg.train_size or n_train, cfg.test_size or n_test
    if cfg.train_size:
        n_train = min(n_train, cfg.train_size)
    if cfg.test_size and cfg.source != "folder":
        n_test = min(n_test, cfg.test_size)
    return {"num_classes": classes, "image_size": side, "train_count": n_train, "test_count": n_test, **extra}


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


def _read(cfg: DataConfig, seed: int, raw_dir: Path) -> tuple[dict, dict, int]:
    """The full splits, where they came from, and the class count."""
    if cfg.source == "synthetic":
        return (synthetic_splits(cfg.train_size or 50_000, cfg.test_size or 10_000, seed),
                {"source": "synthetic", "seed": seed}, SYNTHETIC_CLASSES)
    if cfg.source == "folder":
        splits, classes = folder.read(cfg, seed)
        return splits, {"source": "folder", "path": cfg.path, "classes": classes}, len(classes)
    archive = cifar.fetch(cfg, raw_dir)
    fmt = cifar.FORMATS[cfg.source]
    return cifar.read(cfg.source, archive, raw_dir), {"source": cfg.source, "md5": source_md5(cfg)}, \
        fmt.num_classes


def prepare(cfg: DataConfig, seed: int, out_dir: Path, raw_dir: Path) -> dict:
    """Make the prepared set in ``out_dir`` (atomically) and return its metadata."""
    full, origin, num_classes = _read(cfg, seed, raw_dir)
    splits = {"train": _subset(*full["train"], cfg.train_size, seed),
              "test": full["test"] if cfg.source == "folder" else _subset(*full["test"], cfg.test_size, seed + 1)}
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


def load_prepared(folder_: Path, device: str | torch.device) -> dict:
    """Load and check a prepared set, moving it onto ``device`` once."""
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
        blob = torch.load(folder_ / f"{split}.pt", map_location="cpu", weights_only=True)
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
        out[split] = (x.to(device), y.to(device))
    return out
