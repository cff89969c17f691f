"""An image folder in torchvision's ``ImageFolder`` layout, a data source. ``describe(cfg)`` and
``read(cfg, seed, raw_dir)`` as every source in ``data.SOURCES``; ``read_files`` and ``ImageFiles`` for streaming.

    path/<class>/<image>            every image, split here into train and test
    path/train/<class>/<image>      or ready-made splits: train/ with test/ (or val/)
    path/test/<class>/<image>

Classes are the subfolder names in sorted order, as ImageFolder numbers them. Every image, whatever its format
or colour mode (palette, greyscale, CMYK, RGBA), is converted to RGB and resized to ``data.image_size`` squared,
by ``decode_image`` alone: once by the data stage (resident sets, ``read``), or in the streaming workers at each
epoch (``ImageFiles``), with the same pixels either way.

Real folders hold more than images. Hidden files (``.DS_Store``, ``._x.jpg``) are ignored; other files that are
not images by their suffix (a ``notes.txt``) are skipped with a warning naming them. An image that cannot be read
is, by ``data.bad_files``, skipped with a warning naming it (``skip``) or the end of the stage, naming it
(``stop``). env_check checks every file's header (cached by the folder's fingerprint) and the data stage decodes
every image, so the streaming workers meet only images that read; one that breaks during training (changed on
disk since) stops the run with its name, resumable from its checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import PIL
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from ampbench.config import DataConfig, path_is
from ampbench.errors import ConfigError, DataError

# ImageFolder's (torchvision.datasets.folder.IMG_EXTENSIONS: a test keeps them equal, without importing torchvision
# here) and GIF (its first frame), which PIL reads
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
LAYOUT = "path/<class>/<image>.png, or path/train/<class>/... with path/test/<class>/..."
SUBSETS_TEST = False  # data.test_size is the hold-out count of a folder without splits, not a subset
NAMED = 10  # bad files named in a message; the rest are counted (all of them are listed in data_source.json)
DECODE_DELAY_ENV = "AMPBENCH_DECODE_DELAY_MS"  # a test hook: sleep this long per image a streaming worker decodes


def _classes(folder: Path) -> list[str]:
    return sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))


def _listing(folder: Path) -> tuple[list[Path], list[Path]]:
    """The images of a class folder (by suffix) and its stray files (neither images nor hidden)."""
    images, stray = [], []
    for p in sorted(folder.rglob("*")):
        if any(part.startswith(".") for part in p.relative_to(folder).parts) or not p.is_file():
            continue  # hidden files and whatever hidden folders (.thumbnails, .ipynb_checkpoints) hold
        (images if p.suffix.lower() in IMG_EXTENSIONS else stray).append(p)
    return images, stray


def _split_dirs(root: Path) -> tuple[Path, Path] | None:
    test = next((root / n for n in ("test", "val") if (root / n).is_dir()), None)
    return (root / "train", test) if (root / "train").is_dir() and test is not None else None


def scan(cfg: DataConfig) -> dict:
    """The classes, the image files of each split (or of the whole set) and the stray non-image files, without
    decoding any image."""
    root = Path(cfg.path)
    if not path_is(root, "folder"):
        raise ConfigError(f"params.yaml: data.path = {cfg.path!r}: no such folder; give an image folder in "
                          f"ImageFolder layout ({LAYOUT})")
    split = _split_dirs(root)
    top = split[0] if split else root
    listed = {c: _listing(top / c) for c in _classes(top)}  # each class folder listed once
    images = {c: found for c, (found, _) in listed.items()}
    stray = [p for _, extra in listed.values() for p in extra]
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
        files["test"] = []
        for i, c in enumerate(classes):
            found, extra_files = _listing(split[1] / c) if (split[1] / c).is_dir() else ([], [])
            files["test"] += [(p, i) for p in found]
            stray += extra_files
    return {"classes": classes, "files": files, "split": split is not None, "stray": stray}


def held_out_count(total: int, test_size: int) -> int:
    """Images held out for evaluation from a folder without splits: data.test_size, else a tenth."""
    return min(total - 1, test_size or max(1, total // 10))


class BadImage(Exception):
    """An image file that does not decode; the message says why."""


def decode_image(path: Path, size: int) -> torch.Tensor:
    """One image as uint8 3 x size x size: converted to RGB (any mode), resized bilinearly."""
    try:
        with Image.open(path) as im:
            if im.mode.startswith("I"):  # 16-bit greyscale: its high byte (PIL's RGB would clip its values at 255)
                im = Image.fromarray((np.asarray(im, dtype=np.int64) >> 8).clip(0, 255).astype(np.uint8))
            im = im.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
    except Exception as err:  # PIL raises OSError mostly, but also ValueError, EOFError, struct.error, ...
        raise BadImage(str(err) or type(err).__name__) from None
    return torch.from_numpy(np.array(im, copy=True)).permute(2, 0, 1)  # torchvision's pil_to_tensor for RGB


def header_problem(path: Path) -> str | None:
    """Why ``path``'s header does not read as an image, or None (no pixels decoded: fast enough for every file)."""
    try:
        with Image.open(path) as im:
            im.size  # noqa: B018 - the header's dimensions
    except Exception as err:  # as decode_image: whatever PIL raises on a file that is not an image it reads
        return str(err) or type(err).__name__
    return None


def shown(name: str) -> str:
    """A file name fit for one line of a message: as it is, or with escapes for what would not print (a byte that is
    not UTF-8, which Python holds as a surrogate, as \\xff; a line break as \\n)."""
    if name.isprintable():
        return name
    text = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _key(text: str) -> bytes:
    """A file name's bytes for a digest: the name's own bytes, UTF-8 or not."""
    return text.encode("utf-8", "surrogateescape")


def _named(items: list[str], where: str) -> str:
    more = f", and {len(items) - NAMED} more (all listed in {where})" if len(items) > NAMED else ""
    return "; ".join(shown(item) for item in items[:NAMED]) + more


def bad_file_lines(skipped: dict, where: str = "reports/data_source.json") -> list[str]:
    """The warnings for what a folder's scan or decode skipped, naming each file."""
    out = []
    if skipped.get("not_images"):
        out.append(f"data.path: {len(skipped['not_images'])} file(s) are not images by their suffix and are "
                   f"skipped: {_named(skipped['not_images'], where)}")
    if skipped.get("unreadable"):
        out.append(f"data.path: {len(skipped['unreadable'])} image(s) could not be read and are skipped "
                   f"(data.bad_files: skip): {_named([f'{p} ({why})' for p, why in skipped['unreadable']], where)}")
    return out


def _apply_policy(cfg: DataConfig, unreadable: list[list[str]]) -> None:
    if unreadable and cfg.bad_files == "stop":
        named = _named([f"{p} ({why})" for p, why in unreadable], "the warning list")
        raise DataError(f"data.path = {cfg.path!r}: {len(unreadable)} image(s) could not be read: {named}; "
                        "remove or replace them, or set data.bad_files: skip to train without them")


def _enough(cfg: DataConfig, readable: int, split: bool) -> None:
    if readable < (1 if split else 2):
        raise DataError(f"data.path = {cfg.path!r} has {readable} readable image(s)"
                        + ("" if split else "; a train and a held-out test split need at least two")
                        + "; add images, or replace the unreadable ones")


def _rel(path: Path, cfg: DataConfig) -> str:
    return path.relative_to(cfg.path).as_posix()


def describe(cfg: DataConfig, known: dict | None = None) -> dict:
    """Classes, image side and counts (less the images whose header does not read), and a fingerprint of the files
    (names, sizes, modification times), so the data stage reruns when an image is added, removed or changed.
    ``known`` (the last description) spares re-reading every header when the fingerprint is the same."""
    found = scan(cfg)
    every = found["files"]["train"] + found["files"].get("test", [])
    h = hashlib.sha256(f"Pillow {PIL.__version__}\n".encode())  # another Pillow may read other files
    for path, label in every:
        st = path.stat()
        h.update(_key(f"{_rel(path, cfg)}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n"))
    digest = h.hexdigest()
    if known and known.get("files_sha256") == digest and "unreadable" in known:
        unreadable = known["unreadable"]
    else:
        unreadable = [[_rel(p, cfg), why] for p, _ in tqdm(every, desc="checking images", unit="img",
                                                          disable=len(every) < 5000)
                      if (why := header_problem(p))]
    _apply_policy(cfg, unreadable)
    bad = {p for p, _ in unreadable}
    n = {split: sum(_rel(p, cfg) not in bad for p, _ in fs) for split, fs in found["files"].items()}
    _enough(cfg, n["train"], found["split"])
    if found["split"]:
        n_train, n_test = n["train"], n["test"]
    else:
        n_test = held_out_count(n["train"], cfg.test_size)
        n_train = n["train"] - n_test
    return {"num_classes": len(found["classes"]), "image_size": cfg.image_size, "train_count": n_train,
            "test_count": n_test, "classes": found["classes"], "files_sha256": digest,
            "not_images": [_rel(p, cfg) for p in found["stray"]], "unreadable": unreadable}


class _Decode(Dataset):
    def __init__(self, files: list[tuple[Path, int]], size: int):
        self.files, self.size = files, size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        try:
            return i, decode_image(self.files[i][0], self.size), ""
        except BadImage as err:
            return i, None, str(err)


def _ignore_sigint(_: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the stage's to handle
    torch.set_num_threads(1)


def _decode_all(files: list[tuple[Path, int]], size: int, keep: bool, desc: str):
    """Decode every file (in worker processes when there are many): the images (``keep``) or None, each image's
    per-channel pixel sums and sums of squares (N x 2 x 3, float64), and the files that did not decode."""
    workers = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    workers = workers if len(files) >= 512 and workers > 1 else 0
    loader = DataLoader(_Decode(files, size), batch_size=None, num_workers=workers, worker_init_fn=_ignore_sigint,
                        prefetch_factor=2 if workers else None)  # images in shared memory: few (/dev/shm)
    images = torch.empty(len(files), 3, size, size, dtype=torch.uint8) if keep else None
    sums = torch.zeros(len(files), 2, 3, dtype=torch.float64)
    ok = torch.ones(len(files), dtype=torch.bool)
    bad = []
    for i, x, why in tqdm(loader, desc=desc, unit="img", disable=len(files) < 1000):
        if x is None:
            ok[i] = False
            bad.append((i, why))
            continue
        if keep:
            images[i] = x
        v = x.double().flatten(1)
        sums[i, 0], sums[i, 1] = v.sum(1), (v * v).sum(1)
    bad.sort()
    return (images[ok] if keep and bad else images), sums[ok], ok, bad


def verify(cfg: DataConfig, seed: int, keep: bool) -> dict:
    """Every image decoded once (the unreadable ones skipped or the stage stopped, by data.bad_files), then split:
    per split the (path, label) files, the images (``keep``) and per-image pixel sums; the classes; what was
    skipped. A folder without splits holds out a random test set from the images that read."""
    found = scan(cfg)
    out, unreadable = {}, []
    for split, fs in found["files"].items():
        images, sums, ok, bad = _decode_all(fs, cfg.image_size, keep, f"decoding {split}")
        unreadable += [[_rel(fs[i][0], cfg), why] for i, why in bad]
        out[split] = ([f for f, good in zip(fs, ok.tolist(), strict=True) if good], images, sums)
    _apply_policy(cfg, unreadable)
    if not found["split"]:
        fs, images, sums = out.pop("train")
        _enough(cfg, len(fs), False)
        # the held-out images: the first by a seeded hash of each file's path, so adding, removing or fixing one
        # file moves at most one other image between the splits
        rank = {i: hashlib.sha256(_key(f"{seed}\0{_rel(f, cfg)}")).digest() for i, (f, _) in enumerate(fs)}
        order = sorted(rank, key=rank.get)
        k = held_out_count(len(fs), cfg.test_size)
        for split, idx in (("train", sorted(order[k:])), ("test", sorted(order[:k]))):
            out[split] = ([fs[i] for i in idx], images[idx] if keep else None, sums[idx])
    return {"splits": out, "classes": found["classes"],
            "skipped": {"not_images": [_rel(p, cfg) for p in found["stray"]], "unreadable": unreadable}}


def _origin(cfg: DataConfig, found: dict) -> dict:
    return {"source": "folder", "path": cfg.path, "classes": found["classes"], **found["skipped"]}


def read(cfg: DataConfig, seed: int, raw_dir: Path) -> tuple[dict, dict, int]:
    """The decoded splits, where they came from (with what was skipped), and the class count."""
    found = verify(cfg, seed, keep=True)
    splits = {split: (images, torch.tensor([label for _, label in fs], dtype=torch.int64))
              for split, (fs, images, _) in found["splits"].items()}
    return splits, _origin(cfg, found), len(found["classes"])


def read_files(cfg: DataConfig, seed: int) -> tuple[dict, dict, int]:
    """For streaming: each split's files as (relative paths, labels, per-image pixel sums), every image decoded
    once here to check it (and for the mean and std), none kept; where they came from; the class count."""
    found = verify(cfg, seed, keep=False)
    splits = {split: ([_rel(p, cfg) for p, _ in fs], torch.tensor([label for _, label in fs], dtype=torch.int64),
                      sums) for split, (fs, _, sums) in found["splits"].items()}
    return splits, _origin(cfg, found), len(found["classes"])


def stats_from_sums(sums: torch.Tensor, pixels_per_image: int) -> dict:
    """Per-channel mean and standard deviation (of pixels / 255) from per-image sums and sums of squares."""
    n = max(1, len(sums) * pixels_per_image)
    s, ss = sums[:, 0].sum(0) / 255, sums[:, 1].sum(0) / 255**2
    mean = s / n
    var = (ss - n * mean * mean) / max(1, n - 1)
    std = var.clamp(min=0).sqrt()
    return {"mean": [round(v, 6) for v in mean.tolist()], "std": [round(v, 6) for v in std.tolist()]}


class ImageFiles:
    """A folder's images as an indexable uint8 set (N x 3 x size x size, on the CPU), decoded and resized when
    indexed: in the streaming workers, each epoch. An image that no longer reads raises ``DataError`` naming it."""

    dtype = torch.uint8
    device = torch.device("cpu")

    def __init__(self, root: str | Path, paths: list[str], size: int):
        self.root, self.paths, self.size = Path(root), paths, size
        self.shape = torch.Size((len(paths), 3, size, size))
        try:
            self.delay = float(os.environ.get(DECODE_DELAY_ENV) or 0) / 1000
        except ValueError:
            raise DataError(f"{DECODE_DELAY_ENV} = {os.environ[DECODE_DELAY_ENV]!r} is not a number of "
                            "milliseconds; unset it") from None

    nbytes = 0  # pixels held in memory: none, each batch's are decoded when it is drawn

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, idx) -> torch.Tensor:
        idx = idx.tolist() if isinstance(idx, torch.Tensor) else idx
        out = torch.empty(len(idx), 3, self.size, self.size, dtype=torch.uint8)
        for j, i in enumerate(idx):
            path = self.root / self.paths[i]
            if self.delay:
                time.sleep(self.delay)
            try:
                out[j] = decode_image(path, self.size)
            except BadImage as err:
                raise DataError(f"{shown(str(path))} could not be read ({err}) though the data stage read it: it "
                                "changed on disk during training; restore it and run `dvc repro` to resume from the "
                                "checkpoint, or run `dvc repro` as it is to prepare the folder without it (training "
                                "then starts over, on the new set)") from None
        return out
