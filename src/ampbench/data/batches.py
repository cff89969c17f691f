"""Batches of a uint8 set, augmented and normalised: resident on the device (``DeviceBatches``) or streamed to it
from host memory by DataLoader workers (``stream.StreamBatches``); ``Batches`` is what both share."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

# Batches made at once on the device: as many as fit CHUNK_BYTES of normalised float32 images (at most MAX_CHUNK),
# so the gather, crop, flip and normalisation are a handful of ops per chunk, not per step (a launch-bound step
# pays the host's time for each op it launches); each batch is then a view of its chunk
CHUNK_BYTES = 2 << 20
MAX_CHUNK = 32


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
        # (x - mean) / std as x * (1/std) - mean/std, per channel, laid out as one image's H x W x C values: one
        # multiply-add over each image's bytes as a flat row, which vectorises (a 3-wide broadcast does not, on a
        # CPU), with the same arithmetic element by element
        c, h, w = shape
        inv_std = 1 / (torch.tensor(std, device=self.device) * 255)
        self.inv_std = inv_std.repeat(h * w)
        self.bias = (-torch.tensor(mean, device=self.device) * 255 * inv_std).repeat(h * w)
        out = self.out_size or h
        rank_batch = -(-batch_size // self.world)
        self.chunk = max(1, min(MAX_CHUNK, CHUNK_BYTES // max(1, rank_batch * c * out * out * 4)))

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
        n, h, w, c = x.shape
        flat = x.reshape(n, h * w * c)
        if flat.device.type == "cpu" and flat.dtype == torch.uint8:
            # a CPU kernel first casts a uint8 operand into a float32 copy of its own: cast once here and normalise
            # in place, one float32 chunk made instead of two (CUDA casts inside the kernel)
            flat = flat.to(torch.float32)
            flat = torch.addcmul(self.bias, flat, self.inv_std, out=flat)
        else:
            flat = torch.addcmul(self.bias, flat, self.inv_std)
        x = flat.view(n, h, w, c).permute(0, 3, 1, 2)  # channels_last from the NHWC input
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

    The set is stored once, zero-padded and NHWC. Each epoch draws its order, and every image's crop and flip, at
    its start (from a generator seeded with (seed, epoch), so an epoch can be replayed exactly, from any batch);
    then a chunk of ``chunk`` batches is one ``index_select`` of whole pixels straight from the set (the shuffle,
    the random crop and the flip folded into one index; without augmentation, of whole images) and one
    ``addcmul`` to normalised float32, which comes out channels_last, and each batch a view of it. With
    ``out_size`` (a model that needs larger inputs than the data has), each chunk is then resized on the device.
    Under data parallelism each rank takes its slice of every global batch, augmented as in one process
    (``Batches``).
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
        # this rank's images of each batch, and where in the epoch's order they stand (all of it in one process)
        counts = [self.global_count(i) for i in range(len(self))]
        parts = [self.part(k) for k in counts]
        self.sizes = [s.stop - s.start for s in parts]
        self.offsets = [0]
        for k in self.sizes:
            self.offsets.append(self.offsets[-1] + k)
        self.positions = None if self.world == 1 else torch.tensor(
            [i * batch_size + j for i, s in enumerate(parts) for j in range(s.start, s.stop)], dtype=torch.long,
            device=dev)

    @property
    def nbytes(self) -> int:
        return self.pixels.numel() + self.labels.numel() * self.labels.element_size()

    def _pixel_index(self, sel: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
        """Index of every output pixel in ``self.pixels`` for the images ``sel``, each cropped at (``dy``, ``dx``)
        in its padding and flipped where ``flip``."""
        base = sel.view(-1, 1, 1) * (self.hp * self.wp)
        cols = torch.where(flip, self.shape[2] - 1 - self.cols, self.cols)  # a flip reads the columns in reverse
        return (base + dy * self.wp + self.rows + dx + cols).view(-1)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n, dev = len(self.labels), self.device
        if not self.used:  # an empty set has no batch
            return
        g = self.epoch_generator(epoch, dev)
        # per epoch, not per step: the order, every image's crop and flip, and the labels in one gather
        order = (torch.randperm(n, device=dev, generator=g) if self.shuffle else torch.arange(n, device=dev))
        order = order[:self.used]
        if self.augment:  # drawn for every image of the set: a rank's slice is augmented as in one process
            span = 2 * self.pad + 1
            draws = (torch.randint(0, span, (n, 1, 1), device=dev, generator=g),
                     torch.randint(0, span, (n, 1, 1), device=dev, generator=g),
                     torch.rand(n, 1, 1, device=dev, generator=g) < 0.5)
        if self.positions is not None:  # this rank's slice of every global batch
            order = order[self.positions]
            if self.augment:
                draws = tuple(d[self.positions] for d in draws)
        labels = self.labels[order]
        c, h, w = self.shape
        for first in range(start, len(self.sizes), self.chunk):
            last = min(first + self.chunk, len(self.sizes))
            lo, hi = self.offsets[first], self.offsets[last]
            if self.augment:  # one gather of whole pixels: shuffle, crop and flip in one index
                x = self.pixels.index_select(0, self._pixel_index(order[lo:hi], *(d[lo:hi] for d in draws)))
                x = x.view(-1, h, w, c)
            else:  # whole images: no per-pixel index to build
                x = self.images.index_select(0, order[lo:hi])
            sizes = self.sizes[first:last]
            yield from zip(self.normalise(x).split(sizes), labels[lo:hi].split(sizes), strict=True)
