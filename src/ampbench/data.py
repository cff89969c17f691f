"""Data: fetch and verify CIFAR-10 or make a synthetic set; write it once as uint8 tensors.

Downloading and checksumming use torchvision's own code (progress bar, MD5).
The prepared set is ``train.pt`` / ``test.pt`` (uint8 images N x 3 x 32 x 32,
int64 labels) plus ``meta.json``, written to a temporary folder and renamed, so
a later stage never reads a half-written set. ``DeviceBatches`` keeps the whole
set on the training device and augments there (random crop with padding, flip).
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
import tempfile
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import torch
import torch.nn.functional as F
from torchvision.datasets.utils import check_integrity, download_url, extract_archive

from ampbench.config import DataConfig
from ampbench.errors import DataError

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
CIFAR_DIR = "cifar-10-batches-py"
TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_BATCHES = ["test_batch"]
ARCHIVE_NAME = "cifar-10-python.tar.gz"


# --- CIFAR-10 ----------------------------------------------------------------------------

def fetch_cifar10(cfg: DataConfig, raw_dir: Path) -> Path:
    """Return the path of a verified cifar-10-python.tar.gz: the local archive, or a download.

    A download that fails its checksum is deleted and fetched once more.
    """
    if cfg.archive:
        path = Path(cfg.archive)
        if not check_integrity(str(path), cfg.md5):
            raise DataError(f"data.archive = {cfg.archive!r} fails its MD5 check (expected {cfg.md5}); "
                            "the file is corrupted or not cifar-10-python.tar.gz: download it again")
        return path
    raw_dir.mkdir(parents=True, exist_ok=True)
    path = raw_dir / ARCHIVE_NAME
    last_error: Exception | None = None
    for attempt in (1, 2):
        if path.exists():
            if check_integrity(str(path), cfg.md5):
                print(f"using the verified archive already in {path}", flush=True)
                return path
            path.unlink()  # a cut-short or corrupted earlier download
        try:
            print(f"downloading {cfg.url} (attempt {attempt} of 2)", flush=True)
            if cfg.url.startswith("file:"):  # torchvision's downloader needs an HTTP response length
                shutil.copyfile(url2pathname(urlparse(cfg.url).path), path)
                if not check_integrity(str(path), cfg.md5):
                    raise RuntimeError("File not found or corrupted.")
            else:
                download_url(cfg.url, str(raw_dir), ARCHIVE_NAME, cfg.md5)  # progress bar, MD5 check
            return path
        except (urllib.error.URLError, OSError, RuntimeError, ValueError) as err:
            last_error = err
            print(f"download failed: {err}", flush=True)
    if path.exists():
        path.unlink()
    raise DataError(f"could not fetch a verified CIFAR-10 archive from data.url = {cfg.url!r} "
                    f"({last_error}); check the URL or the network, or set data.archive to a local "
                    f"{ARCHIVE_NAME}")


def _read_batches(folder: Path, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = [], []
    for name in names:
        path = folder / name
        if not path.is_file():
            raise DataError(f"the CIFAR-10 archive has no {CIFAR_DIR}/{name}; it is not cifar-10-python.tar.gz")
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        data = batch[b"data"] if b"data" in batch else batch["data"]
        labs = batch[b"labels"] if b"labels" in batch else batch["labels"]
        images.append(torch.as_tensor(data, dtype=torch.uint8).reshape(-1, *IMAGE_SHAPE))
        labels.append(torch.as_tensor(labs, dtype=torch.int64))
    return torch.cat(images), torch.cat(labels)


def read_cifar10(archive: Path, workdir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Extract the archive to a scratch folder and read its train and test batches."""
    workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        extract_archive(str(archive), tmp)
        folder = Path(tmp) / CIFAR_DIR
        return {"train": _read_batches(folder, TRAIN_BATCHES), "test": _read_batches(folder, TEST_BATCHES)}


# --- synthetic ---------------------------------------------------------------------------

def synthetic(n: int, seed: int, split_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable CIFAR-shaped set: each class is a smooth colour pattern, shifted and noised.

    The class templates depend only on ``seed``; ``split_seed`` draws the images,
    so train and test share classes but not images.
    """
    g = torch.Generator().manual_seed(seed)
    templates = F.interpolate(torch.rand(NUM_CLASSES, 3, 6, 6, generator=g), size=(40, 40),
                              mode="bicubic", align_corners=False)
    g = torch.Generator().manual_seed(split_seed)
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    images = torch.empty(n, *IMAGE_SHAPE, dtype=torch.uint8)
    for start in range(0, n, 4096):  # chunks keep the float copy small
        y = labels[start:start + 4096]
        m = len(y)
        dy, dx = torch.randint(0, 9, (2, m), generator=g)
        rows = (dy[:, None] + torch.arange(32))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(32))[:, None, None, :]
        x = templates[y[:, None, None, None], torch.arange(3)[None, :, None, None], rows, cols]
        gain = 0.6 + 0.8 * torch.rand(m, 3, 1, 1, generator=g)
        x = 0.5 + gain * (x - 0.5) + 0.22 * torch.randn(m, *IMAGE_SHAPE, generator=g)
        images[start:start + m] = (x.clamp(0, 1) * 255).round().to(torch.uint8)
    return images, labels


def synthetic_splits(n_train: int, n_test: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Train and test sets of the same classes (templates from ``seed``), with different images."""
    return {"train": synthetic(n_train, seed, seed + 1), "test": synthetic(n_test, seed, seed + 2)}


# --- preparing and loading ---------------------------------------------------------------

def _subset(images: torch.Tensor, labels: torch.Tensor, size: int, seed: int):
    if size == 0 or size >= len(labels):
        return images, labels
    idx = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))[:size]
    idx = idx.sort().values
    return images[idx].contiguous(), labels[idx].contiguous()


def prepare(cfg: DataConfig, seed: int, out_dir: Path, raw_dir: Path) -> dict:
    """Make the prepared set in ``out_dir`` (atomically) and return its metadata."""
    if cfg.source == "synthetic":
        n_train = cfg.train_size or 50_000
        n_test = cfg.test_size or 10_000
        splits = synthetic_splits(n_train, n_test, seed)
        origin = {"source": "synthetic", "seed": seed}
    else:
        archive = fetch_cifar10(cfg, raw_dir)
        full = read_cifar10(archive, raw_dir)
        splits = {"train": _subset(*full["train"], cfg.train_size, seed),
                  "test": _subset(*full["test"], cfg.test_size, seed + 1)}
        origin = {"source": "cifar10", "md5": cfg.md5}
    meta = {
        **origin,
        "train_count": len(splits["train"][1]),
        "test_count": len(splits["test"][1]),
        "num_classes": NUM_CLASSES,
        "image_shape": list(IMAGE_SHAPE),
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
            **_stats(splits["train"][0])}
    return {"meta": meta, **{k: tuple(t.to(device) for t in v) for k, v in splits.items()}}


def load_prepared(folder: Path, device: str | torch.device) -> dict:
    """Load and check a prepared set, moving it onto ``device`` once."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"{folder} holds no prepared data set; run the data stage first (dvc repro data)")
    meta = json.loads(meta_path.read_text())
    out = {"meta": meta}
    for split in ("train", "test"):
        blob = torch.load(folder / f"{split}.pt", map_location="cpu", weights_only=True)
        x, y = blob["images"], blob["labels"]
        count = meta[f"{split}_count"]
        problem = None
        if x.dtype != torch.uint8 or tuple(x.shape[1:]) != IMAGE_SHAPE:
            problem = f"images are {x.dtype} {tuple(x.shape)}, expected uint8 N x 3 x 32 x 32"
        elif len(x) != count or len(y) != count:
            problem = f"{len(x)} images and {len(y)} labels, expected {count}"
        elif count and (int(y.min()) < 0 or int(y.max()) >= NUM_CLASSES):
            problem = f"labels outside 0..{NUM_CLASSES - 1}"
        if problem:
            raise DataError(f"{folder}/{split}.pt is damaged ({problem}); rerun the data stage "
                            "(dvc repro -f data)")
        out[split] = (x.to(device), y.to(device))
    return out


class DeviceBatches:
    """Batches of a device-resident uint8 set, cropped, flipped and normalised on the device.

    The set is stored once, zero-padded and NHWC; a batch is one ``index_select``
    of whole pixels straight from it (the shuffle, the random crop and the flip
    folded into one index), then one conversion to normalised float32, which
    comes out channels_last. Each epoch's order and augmentation come from a
    generator seeded with (seed, epoch), so an epoch can be replayed exactly.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, mean, std, *,
                 augment: bool, shuffle: bool, channels_last: bool, seed: int = 0, pad: int = 4):
        n, c, h, w = images.shape
        self.pad = pad if augment else 0
        p = self.pad
        self.hp, self.wp = h + 2 * p, w + 2 * p
        self.pixels = F.pad(images.permute(0, 2, 3, 1), (0, 0, p, p, p, p)).contiguous().view(-1, c)
        self.labels, self.shape = labels, (c, h, w)
        self.batch_size, self.augment, self.shuffle = batch_size, augment, shuffle
        self.channels_last, self.seed = channels_last, seed
        dev = self.device = images.device
        self.mean = torch.tensor(mean, device=dev).view(1, 3, 1, 1) * 255
        self.inv_std = 1 / (torch.tensor(std, device=dev).view(1, 3, 1, 1) * 255)
        self.rows = torch.arange(h, device=dev).view(1, h, 1) * self.wp
        self.cols = torch.arange(w, device=dev).view(1, 1, w)

    @property
    def nbytes(self) -> int:
        return self.pixels.numel() + self.labels.numel() * self.labels.element_size()

    def __len__(self) -> int:
        return math.ceil(len(self.labels) / self.batch_size)

    def _pixel_index(self, sel: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """Index of every output pixel in ``self.pixels``: image, then a random crop offset and flip."""
        n, w = len(sel), self.shape[2]
        base = sel.view(n, 1, 1) * (self.hp * self.wp)
        if not self.augment:
            return (base + self.rows + self.cols).view(-1)
        dy = torch.randint(0, 2 * self.pad + 1, (n, 1, 1), device=self.device, generator=g)
        dx = torch.randint(0, 2 * self.pad + 1, (n, 1, 1), device=self.device, generator=g)
        flip = torch.rand(n, 1, 1, device=self.device, generator=g) < 0.5
        cols = torch.where(flip, w - 1 - self.cols, self.cols)  # a flip reads the columns in reverse
        return (base + dy * self.wp + self.rows + dx + cols).view(-1)

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.labels)
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + epoch)
        order = (torch.randperm(n, device=self.device, generator=g) if self.shuffle
                 else torch.arange(n, device=self.device))
        c, h, w = self.shape
        for start in range(0, n, self.batch_size):
            sel = order[start:start + self.batch_size]
            x = self.pixels.index_select(0, self._pixel_index(sel, g)).view(len(sel), h, w, c)
            x = x.permute(0, 3, 1, 2).float().sub_(self.mean).mul_(self.inv_std)  # one new tensor, channels_last
            if not self.channels_last:
                x = x.contiguous()
            yield x, self.labels[sel]
