"""Data: CIFAR-10, CIFAR-100, an image folder or a synthetic set, written once as uint8 tensors.

Each source is a module of this package, registered in ``SOURCES`` with the same ``describe`` and ``read``:
a new source is one module and one line there (and its name in ``config.DATA_SOURCES``).
Downloading and checksumming use torchvision's own code (progress bar, MD5).
The prepared set is ``train.pt`` / ``test.pt`` (uint8 images N x 3 x H x W, int64 labels) plus ``meta.json``
(counts, classes, image shape, mean and std), written to a temporary folder and renamed, so a later stage never
reads a half-written set. A folder that streams (``form="files"``) is not written out again: its prepared set
is ``files.json``, the images that read with their labels, and ``meta.json``. ``DeviceBatches`` keeps the whole
set on the training device and augments there (random crop with padding, flip); ``StreamBatches``
(``data.placement: stream``) leaves it memory-mapped in host memory, or a folder's files on disk, and streams
each batch to the device through DataLoader workers. The feeds live in ``data.batches`` and ``data.stream``,
which preparing the set does not import (the data stage depends on what makes the set, not on how it is read).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch

from ampbench.config import DataConfig
from ampbench.data import cifar, folder
from ampbench.data import synthetic as synthetic_source
from ampbench.data.cifar import ARCHIVE_NAME
from ampbench.data.synthetic import NUM_CLASSES as SYNTHETIC_CLASSES
from ampbench.data.synthetic import splits as synthetic_splits
from ampbench.data.synthetic import synthetic
from ampbench.errors import DataError
from ampbench.results.modes import plain_mode

__all__ = ["ARCHIVE_NAME", "FILE_LIST", "describe", "load_prepared",
           "prepare", "record", "resident_bytes", "synthetic", "synthetic_in_memory", "synthetic_splits"]

FORMS = ("tensors", "files")  # a prepared set: decoded uint8 tensors, or a folder's list of files (streamed)
FILE_LIST = "files.json"  # a streamed folder's prepared set: its images' paths and labels, per split
PAD = 4  # the augmentation's crop padding, stored with the set on the device
# The sources, by data.source: each module has describe(cfg) -> dict, read(cfg, seed, raw_dir) -> (splits,
# origin, classes) and SUBSETS_TEST (whether data.test_size takes a subset of its test split).
SOURCES = {"cifar10": cifar, "cifar100": cifar, "folder": folder, "synthetic": synthetic_source}


def describe(cfg: DataConfig, known: dict | None = None) -> dict:
    """Classes, image side and image counts of the set ``cfg`` makes, known without preparing it (a folder's
    also a fingerprint of its files and what it skips; ``known``, the last description, spares work a folder has
    done); a source's bad params.yaml value (a missing archive or folder) stops here."""
    source = SOURCES[cfg.source]
    desc = source.describe(cfg, known) if source is folder else source.describe(cfg)
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
    keep = _subset_index(len(labels), size, seed)
    return (images, labels) if keep is None else (images[keep].contiguous(), labels[keep].contiguous())


def _subset_index(n: int, size: int, seed: int) -> list[int] | None:
    if size == 0 or size >= n:
        return None
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:size].sort().values.tolist()


def prepare(cfg: DataConfig, seed: int, out_dir: Path, raw_dir: Path, form: str = "tensors") -> dict:
    """Make the prepared set in ``out_dir`` (atomically) and return its metadata. ``form``: ``tensors`` (the
    decoded images) or, for a folder that streams, ``files`` (the list of its images that read)."""
    if form not in FORMS:
        raise DataError(f"data form {form!r} is not one of {', '.join(FORMS)}; rerun env_check (dvc repro)")
    if form == "files":
        if cfg.source != "folder":
            raise DataError(f"data.source = {cfg.source!r} has no files to stream; it streams its prepared tensors")
        return _prepare_files(cfg, seed, Path(out_dir))
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
    files = {f"{split}.pt": (lambda f, x=x, y=y: torch.save({"images": x, "labels": y}, f))
             for split, (x, y) in splits.items()}
    return _write(Path(out_dir), meta, files)


def _prepare_files(cfg: DataConfig, seed: int, out_dir: Path) -> dict:
    splits, origin, num_classes = folder.read_files(cfg, seed)
    keep = _subset_index(len(splits["train"][0]), cfg.train_size, seed)
    if keep is not None:
        paths, labels, sums = splits["train"]
        splits["train"] = ([paths[i] for i in keep], labels[keep], sums[keep])
    s = cfg.image_size
    meta = {**origin, "form": "files", "train_count": len(splits["train"][0]),
            "test_count": len(splits["test"][0]), "num_classes": num_classes, "image_shape": [3, s, s],
            **folder.stats_from_sums(splits["train"][2], s * s)}
    listing = {split: {"paths": paths, "labels": labels.tolist()} for split, (paths, labels, _) in splits.items()}
    text = json.dumps(listing, separators=(",", ":")) + "\n"
    return _write(out_dir, meta, {FILE_LIST: lambda f: Path(f).write_text(text)})


def _write(out_dir: Path, meta: dict, files: dict) -> dict:
    """``files`` (name -> writer) and meta.json into ``out_dir``, through a temporary folder and a rename."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for name, write in files.items():
            write(tmp / name)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.chmod(plain_mode(folder=True))  # a plain mkdir's mode: mkdtemp's 0700 would hide the set from others
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
    if meta.get("form") == "files":
        return _load_files(folder_, meta, stream, out)
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


def _load_files(folder_: Path, meta: dict, stream: bool, out: dict) -> dict:
    """A streamed folder's prepared set: its images, decoded when read (``folder.ImageFiles``), and labels."""
    if not stream:
        raise DataError(f"{folder_} lists a folder's images for streaming (data.placement: stream); set "
                        "data.placement: stream, or rerun env_check and the data stage (dvc repro) to decode it")
    root = Path(meta["path"])
    if not root.is_dir():
        raise DataError(f"{folder_} lists the images of {meta['path']}, which is no longer a folder; restore it, "
                        "or set data.path and rerun the pipeline (dvc repro)")
    try:
        listing = json.loads((folder_ / FILE_LIST).read_text())
        for split in ("train", "test"):
            paths, labels = listing[split]["paths"], torch.tensor(listing[split]["labels"], dtype=torch.int64)
            if len(paths) != meta[f"{split}_count"] or len(labels) != len(paths):
                raise ValueError(f"{len(paths)} paths, expected {meta[f'{split}_count']}")
            out[split] = paths, labels
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{folder_}/{FILE_LIST} is damaged ({err}); rerun the data stage (dvc repro -f data)") from None
    for split in ("train", "test"):
        paths, labels = out[split]
        out[split] = (folder.ImageFiles(root, paths, meta["image_shape"][-1]), labels)
    return out


def record(folder_: Path, meta: dict) -> dict:
    """What a tracker records of a prepared set: its name, where it came from, a digest of its files (the same
    files, the same digest) and its splits' sizes."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(folder_).iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    where = {"folder": meta.get("path"), "synthetic": f"synthetic, seed {meta.get('seed')}"}.get(meta["source"])
    return {"name": meta["source"], "digest": h.hexdigest()[:16],
            "source": where or f"{meta['source']} archive, md5 {meta.get('md5')}",
            "train_count": meta["train_count"], "test_count": meta["test_count"],
            "num_classes": meta.get("num_classes"), "image_shape": meta.get("image_shape")}
