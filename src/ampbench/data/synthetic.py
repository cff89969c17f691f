"""A learnable CIFAR-shaped synthetic set, a data source: no download, for pure speed runs and tests.
``describe(cfg)`` and ``read(cfg, seed, raw_dir)`` as every source in ``data.SOURCES``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ampbench.config import DataConfig

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
COUNTS = (50_000, 10_000)  # train and test images unless data.train_size / data.test_size say
SUBSETS_TEST = True


def describe(cfg: DataConfig) -> dict:
    return {"num_classes": NUM_CLASSES, "image_size": IMAGE_SHAPE[-1], "train_count": cfg.train_size or COUNTS[0],
            "test_count": cfg.test_size or COUNTS[1]}


def read(cfg: DataConfig, seed: int, raw_dir: Path) -> tuple[dict, dict, int]:
    """The splits, made from ``seed`` (nothing is downloaded), their origin, and the class count."""
    made = splits(cfg.train_size or COUNTS[0], cfg.test_size or COUNTS[1], seed)
    return made, {"source": "synthetic", "seed": seed}, NUM_CLASSES


def synthetic(n: int, seed: int, split_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each class is a smooth colour pattern, shifted and noised.

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


def splits(n_train: int, n_test: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Train and test sets of the same classes (templates from ``seed``), with different images."""
    return {"train": synthetic(n_train, seed, seed + 1), "test": synthetic(n_test, seed, seed + 2)}
