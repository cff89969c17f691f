"""Streaming placement: the set stays in host memory (the prepared tensors memory-mapped, not loaded whole) or on
disk (a folder's image files, decoded and resized in the workers) and DataLoader workers crop and flip each batch
there; the batch goes to the device through pinned memory with a
non-blocking copy, and is normalised on the device as the resident path does.

Randomness is per sample, from (seed, epoch, index), never from a worker's RNG: the batches are the same whatever
the number of workers, a resumed run starts at any batch of an epoch exactly, and under data parallelism each
rank reads only its slice of every global batch and augments it as one process would. The order of an epoch
comes from the same (seed, epoch) generator as ``DeviceBatches``'s, on the CPU (the two placements need not
match bit for bit). The workers persist from epoch to epoch (started once, at the first batch, which is a
warm-up step). Workers ignore SIGINT: a Ctrl-C reaches the training process alone, which stops at a step
boundary and shuts its workers down, with no traceback from them.
"""

from __future__ import annotations

import multiprocessing
import random
import signal
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from ampbench.data.batches import Batches
from ampbench.errors import AmpbenchError, DataError

PREFETCH = 2  # batches each worker prepares ahead of the step (each one a batch in shared memory)


def sample_draws(seed: int, epoch: int, index: int, pad: int) -> tuple[int, int, bool]:
    """The crop offsets (dy, dx) and the flip of image ``index`` in ``epoch``: a function of the three alone."""
    r = random.Random((seed * 1_000_003 + epoch) * 2**32 + index)
    return r.randrange(2 * pad + 1), r.randrange(2 * pad + 1), r.random() < 0.5


class _Crops(Dataset):
    """One item is one rank's slice of a batch: (epoch, image indices) -> (uint8 N x H x W x C, labels)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, pad: int, seed: int):
        self.images, self.labels, self.pad, self.seed = images, labels, pad, seed

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: tuple[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor] | dict:
        epoch, idx = key
        try:  # reads these images alone: from a memory-mapped set, or a folder's files decoded here
            x = self.images[idx]
        except AmpbenchError as err:  # the training process raises it: one line, not a worker's traceback
            return {"error": str(err)}
        if self.pad:
            p, (h, w) = self.pad, x.shape[-2:]
            padded = F.pad(x, (p, p, p, p))
            for j, i in enumerate(idx):
                dy, dx, flip = sample_draws(self.seed, epoch, i, p)
                crop = padded[j, :, dy:dy + h, dx:dx + w]
                x[j] = crop.flip(-1) if flip else crop
        return x.permute(0, 2, 3, 1).contiguous(), self.labels[idx]


class _EpochKeys(Sampler):
    """The keys of the epoch the loader runs next, set in the training process before each pass: one loader, and
    one set of worker processes, serves every epoch (no workers started inside a timed step)."""

    def __init__(self):
        self.keys: list = []

    def __iter__(self):
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


def _worker_init(_: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    torch.set_num_threads(1)  # one core per worker: the workers, not their threads, run side by side


class StreamBatches(Batches):
    """Batches of a host-resident uint8 set (N x C x H x W on the CPU: a tensor, or a folder's ``ImageFiles``),
    prepared by ``workers`` DataLoader worker processes (0: in the training process) and moved to ``device`` ahead
    of the step."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, mean, std, *,
                 augment: bool, shuffle: bool, channels_last: bool, device: torch.device | str, workers: int = 0,
                 seed: int = 0, pad: int = 4, out_size: int | None = None, shard: tuple[int, int] = (0, 1),
                 drop_last: bool = False):
        n, c, h, w = images.shape
        super().__init__(n, (c, h, w), batch_size, mean, std, augment=augment, shuffle=shuffle,
                         channels_last=channels_last, seed=seed, pad=pad, out_size=out_size, shard=shard,
                         drop_last=drop_last, device=device)
        self.workers = workers
        self.sampler = _EpochKeys()
        # fork: the workers share the memory-mapped set (spawn or forkserver would pickle it into each worker)
        context = "fork" if workers and "fork" in multiprocessing.get_all_start_methods() else None
        self.loader = DataLoader(_Crops(images, labels, self.pad, seed), sampler=self.sampler, batch_size=None,
                                 num_workers=workers, pin_memory=self.device.type == "cuda",
                                 worker_init_fn=_worker_init, prefetch_factor=PREFETCH if workers else None,
                                 persistent_workers=workers > 0, multiprocessing_context=context)

    @property
    def nbytes(self) -> int:
        return 0  # nothing of the set stays on the device between steps

    def keys(self, epoch: int, start: int = 0) -> list[tuple[int, list[int]]]:
        """This rank's (epoch, image indices) of each batch of the epoch, from batch ``start`` on."""
        order = (torch.randperm(self.count, generator=self.epoch_generator(epoch, "cpu")) if self.shuffle
                 else torch.arange(self.count))
        out = []
        for first in range(start * self.batch_size, self.used, self.batch_size):
            sel = order[first:first + self.batch_size]
            out.append((epoch, sel[self.part(len(sel))].tolist()))
        return out

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.sampler.keys = self.keys(epoch, start)
        for item in self.loader:  # a new pass resets the persistent workers, dropping what an unfinished one left
            if isinstance(item, dict):
                raise DataError(item["error"])
            x, y = item
            x = x.to(self.device, non_blocking=True)
            yield self.normalise(x), y.to(self.device, non_blocking=True)
