"""An image folder in torchvision's ``ImageFolder`` layout, a data source: decoded and resized once to uint8
tensors. ``describe(cfg)`` and ``read(cfg, seed, raw_dir)`` as every source in ``data.SOURCES``.

    path/<class>/<image>            every image, split here into train and test
    path/train/<class>/<image>      or ready-made splits: train/ with test/ (or val/)
    path/test/<class>/<image>

Classes are the subfolder names in sorted order, as ImageFolder numbers them.
Every image is converted to RGB and resized to ``data.image_size`` squared.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms.functional import pil_to_tensor
from tqdm import tqdm

from ampbench.config import DataConfig
from ampbench.errors import ConfigError, DataError

LAYOUT = "path/<class>/<image>.png, or path/train/<class>/... with path/test/<class>/..."
SUBSETS_TEST = False  # data.test_size is the hold-out count of a folder without splits, not a subset


def _classes(folder: Path) -> list[str]:
    return sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMG_EXTENSIONS and p.is_file())


def _split_dirs(root: Path) -> tuple[Path, Path] | None:
    test = next((root / n for n in ("test", "val") if (root / n).is_dir()), None)
    return (root / "train", test) if (root / "train").is_dir() and test is not None else None


def scan(cfg: DataConfig) -> dict:
    """The classes and the image files of each split (or of the whole set), without decoding any image."""
    root = Path(cfg.path)
    if not root.is_dir():
        raise ConfigError(f"params.yaml: data.path = {cfg.path!r}: no such folder; give an image folder in "
                          f"ImageFolder layout ({LAYOUT})")
    split = _split_dirs(root)
    top = split[0] if split else root
    images = {c: _images(top / c) for c in _classes(top)}  # each class folder listed once
    classes = [c for c, found in images.items() if found]
    where = f"data.path = {cfg.path!r}" + (" (its train/ folder)" if split else "")
    if not images:
        raise DataError(f"{where} holds no class subfolders; put each class's images in a folder of its own: "
                        f"{LAYOUT}")
    if not classes:
        raise DataError(f"{where} holds no images ({', '.join(IMG_EXTENSIONS[:4])}, ...) in its class folders; "
                        f"the layout is {LAYOUT}")
    if len(classes) < 2:
        raise DataError(f"{where} has one class ({classes[0]}); a classifier needs at least two class folders")
    files = {"train": [(p, i) for i, c in enumerate(classes) for p in images[c]]}
    if split:
        extra = sorted(set(_classes(split[1])) - set(classes))
        if extra:
            raise DataError(f"data.path = {cfg.path!r}: {split[1].name}/ has classes that train/ lacks "
                            f"({', '.join(extra[:5])}); give both splits the same class folders")
        files["test"] = [(p, i) for i, c in enumerate(classes) for p in _images(split[1] / c)]
    return {"classes": classes, "files": files, "split": split is not None}


def held_out_count(total: int, test_size: int) -> int:
    """Images held out for evaluation from a folder without splits: data.test_size, else a tenth."""
    return min(total - 1, test_size or max(1, total // 10))


def _decode(files: list[tuple[Path, int]], size: int, desc: str) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.empty(len(files), 3, size, size, dtype=torch.uint8)
    for i, (path, _) in enumerate(tqdm(files, desc=desc, unit="img", disable=len(files) < 1000)):
        try:
            with Image.open(path) as im:
                im = im.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
        except OSError as err:
            raise DataError(f"{path} could not be read as an image ({err}); remove or replace it") from None
        images[i] = pil_to_tensor(im)
    return images, torch.tensor([label for _, label in files], dtype=torch.int64)


def describe(cfg: DataConfig) -> dict:
    """Classes, image side and counts, and a fingerprint of the files (names, sizes, modification times), so the
    data stage reruns when an image is added, removed or changed."""
    found = scan(cfg)
    h = hashlib.sha256()
    for path, label in found["files"]["train"] + found["files"].get("test", []):
        st = path.stat()
        h.update(f"{path.relative_to(cfg.path)}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    if found["split"]:
        n_train, n_test = len(found["files"]["train"]), len(found["files"]["test"])
    else:
        total = len(found["files"]["train"])
        n_test = held_out_count(total, cfg.test_size)
        n_train = total - n_test
    return {"num_classes": len(found["classes"]), "image_size": cfg.image_size, "train_count": n_train,
            "test_count": n_test, "classes": found["classes"], "files_sha256": h.hexdigest()}


def read(cfg: DataConfig, seed: int, raw_dir: Path) -> tuple[dict, dict, int]:
    """The decoded splits, where they came from, and the class count."""
    splits, classes = decode(cfg, seed)
    return splits, {"source": "folder", "path": cfg.path, "classes": classes}, len(classes)


def decode(cfg: DataConfig, seed: int) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[str]]:
    """Decode the folder into train and test tensors; a folder without splits holds out a random test set."""
    found = scan(cfg)
    files = found["files"]
    if not found["split"]:
        every = files["train"]
        order = torch.randperm(len(every), generator=torch.Generator().manual_seed(seed)).tolist()
        k = held_out_count(len(every), cfg.test_size)
        files = {"train": [every[i] for i in sorted(order[k:])], "test": [every[i] for i in sorted(order[:k])]}
    out = {split: _decode(fs, cfg.image_size, f"decoding {split}") for split, fs in files.items()}
    return out, found["classes"]
