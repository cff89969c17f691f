"""Batches of a uint8 set, augmented and normalised: resident on the device (``DeviceBatches``) or streamed to it
from host memory by DataLoader workers (``stream.StreamBatches``); ``Batches`` is what both share."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F


class Batches:
    """The shape of an epoch, shared by every placement: which images form each global batch, each rank's slice
    of it, and the last step's normalisation to float32 on the device.

    With ``shard=(rank, world)`` (data-parallel training) the batches are the same global batches as in one
    process, and each rank takes its own slice of every one of them (slices differing by at most one image); in
    training (``shuffle``) a last global batch smaller than the world is dropped. With ``drop_last`` (training) a
    last batch smaller than the others is dropped too: a new shape would make cuDNN autotune (or torch.compile
    recompile) inside a timed step, once an epoch.
    """

    def __init__(self, n: int, shape: tuple[int, int, int], batch_size: int, mean, std, *, augment: bool,
                 shuffle: bool, channels_last: bool, seed: int, pad: int, out_size: int | None,
                 shard: tuple[int, int], drop_last: bool, device: torch.device):
        self.rank, self.world = shard
        tail = n % batch_size
        if drop_last and n >= batch_size or shuffle and 0 < tail < self.world:  # one batch shape for every step
            self.used = n - tail
        else:  # evaluation keeps every image
            self.used = n
        self.count, self.shape = n, shape
        self.pad = pad if augment else 0
        self.batch_size, self.augment, self.shuffle = batch_size, augment, shuffle
        self.channels_last, self.seed = channels_last, seed
        self.out_size = out_size if out_size and out_size != shape[1] else None
        self.device = torch.device(device)
        self.inv_std = 1 / (torch.tensor(std, device=self.device).view(1, 3, 1, 1) * 255)
        self.bias = -torch.tensor(mean, device=self.device).view(1, 3, 1, 1) * 255 * self.inv_std

    def __len__(self) -> int:
        return math.ceil(self.used / self.batch_size)

    def global_count(self, i: int) -> int:
        """Images in global batch ``i`` of an epoch (over all ranks)."""
        return min(self.batch_size, self.used - i * self.batch_size)

    def part(self, n: int) -> slice:
        """This rank's slice of a global batch of ``n`` images."""
        q, r = divmod(n, self.world)
        lo = self.rank * q + min(self.rank, r)
        return slice(lo, lo + q + (self.rank < r))

    def epoch_generator(self, epoch: int, device: torch.device | str) -> torch.Generator:
        """The generator of an epoch's order (and, on the device, its augmentation): seeded with (seed, epoch)."""
        return torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + epoch)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 N x H x W x C on the device -> normalised float32 N x C x H x W (channels_last unless not wanted)."""
        # (x - mean) / std as x * (1/std) - mean/std, in one op; channels_last from the NHWC input
        x = torch.addcmul(self.bias, x.permute(0, 3, 1, 2), self.inv_std)
        if self.out_size:  # bilinear keeps channels_last
            x = F.interpolate(x, size=(self.out_size, self.out_size), mode="bilinear", align_corners=False)
        return x if self.channels_last else x.contiguous()

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches from batch ``start`` on (a resumed run), as this rank's (images, labels)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of the set held on the training device."""
        raise NotImplementedError


class DeviceBatches(Batches):
    """Batches of a device-resident uint8 set, cropped, flipped and normalised on the device.

    The set is stored once, zero-padded and NHWC; a batch is one ``index_select``
    of whole pixels straight from it (the shuffle, the random crop and the flip
    folded into one index; without augmentation, of whole images), then one
    ``addcmul`` to normalised float32, which comes out channels_last. With
    ``out_size`` (a model that needs larger inputs than the data has), each
    batch is then resized on the device. Each epoch's order and augmentation
    come from a generator seeded with (seed, epoch), so an epoch can be
    replayed exactly. Under data parallelism each rank's slice is augmented as in one process (``Batches``).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, mean, std, *,
                 augment: bool, shuffle: bool, channels_last: bool, seed: int = 0, pad: int = 4,
                 out_size: int | None = None, shard: tuple[int, int] = (0, 1), drop_last: bool = False):
        n, c, h, w = images.shape
        super().__init__(n, (c, h, w), batch_size, mean, std, augment=augment, shuffle=shuffle,
                         channels_last=channels_last, seed=seed, pad=pad, out_size=out_size, shard=shard,
                         drop_last=drop_last, device=images.device)
        p = self.pad
        self.hp, self.wp = h + 2 * p, w + 2 * p
        self.pixels = F.pad(images.permute(0, 2, 3, 1), (0, 0, p, p, p, p)).contiguous().view(-1, c)
        self.labels = labels
        dev = self.device
        self.images = self.pixels.view(n, self.hp, self.wp, c)  # whole images: read as such when not cropping
        self.rows = torch.arange(h, device=dev).view(1, h, 1) * self.wp
        self.cols = torch.arange(w, device=dev).view(1, 1, w)

    @property
    def nbytes(self) -> int:
        return self.pixels.numel() + self.labels.numel() * self.labels.element_size()

    def _pixel_index(self, sel: torch.Tensor, g: torch.Generator, part: slice = slice(None)) -> torch.Tensor:
        """Index of every output pixel in ``self.pixels`` for ``sel[part]``: image, then a random crop and flip.

        The random numbers are drawn for all of ``sel``, so a rank's slice is augmented as in one process.
        """
        n, w = len(sel), self.shape[2]
        if not self.augment:
            return (sel[part].view(-1, 1, 1) * (self.hp * self.wp) + self.rows + self.cols).view(-1)
        dy = torch.randint(0, 2 * self.pad + 1, (n, 1, 1), device=self.device, generator=g)[part]
        dx = torch.randint(0, 2 * self.pad + 1, (n, 1, 1), device=self.device, generator=g)[part]
        flip = torch.rand(n, 1, 1, device=self.device, generator=g)[part] < 0.5
        base = sel[part].view(-1, 1, 1) * (self.hp * self.wp)
        cols = torch.where(flip, w - 1 - self.cols, self.cols)  # a flip reads the columns in reverse
        return (base + dy * self.wp + self.rows + dx + cols).view(-1)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.labels)
        g = self.epoch_generator(epoch, self.device)
        order = (torch.randperm(n, device=self.device, generator=g) if self.shuffle
                 else torch.arange(n, device=self.device))
        c, h, w = self.shape
        # per epoch, not per step: the batches' indices, and their labels in one gather (each batch's a view)
        order = order[:self.used]
        if not len(order):  # an empty set has no batch (split would give one empty chunk)
            return
        labels = self.labels[order].split(self.batch_size)
        for i, (sel, lab) in enumerate(zip(order.split(self.batch_size), labels, strict=True)):
            part = self.part(len(sel)) if self.world > 1 else None  # None: all of it (one process)
            if self.augment:  # one gather of whole pixels: shuffle, crop and flip in one index
                index = self._pixel_index(sel, g, part or slice(None))  # drawn for a skipped batch too
                if i < start:
                    continue
                x = self.pixels.index_select(0, index).view(-1, h, w, c)
            elif i < start:
                continue
            else:  # whole images: no per-pixel index to build
                x = self.images.index_select(0, sel if part is None else sel[part])
            yield self.normalise(x), lab if part is None else lab[part]
