"""Input pipeline: the set resident on the device against streaming it, side by side in one process.

    python benchmarks/input_pipeline.py                                  # small CNN, CPU, 4,096 generated JPEGs
    python benchmarks/input_pipeline.py --device cuda --arch resnet18 --precision fp16 --batch 256 --workers 8
    python benchmarks/input_pipeline.py --folder path/to/your/images --side 64

One model, one precision, one batch, the same images; each feed trains one epoch through ampbench's engine
(``runner.train``, the code `dvc repro` runs) and reports img/s after the warm-up steps and the share of each
step the device waited for data (the engine's clock, synchronised):

- device: the decoded uint8 set resident on the device, cropped and flipped there (``data.placement: device``);
- stream, memory: the decoded set memory-mapped in host memory, cropped and flipped in DataLoader workers,
  through pinned memory and non-blocking copies (``stream`` for CIFAR, the synthetic set, a folder that fits);
- stream, JPEG folder: the folder's files decoded and resized in the workers each epoch (``stream`` for a folder);
- torchvision ImageFolder: the baseline a user would write for a folder: ``datasets.ImageFolder`` (the same
  training images) with RandomCrop(padding=4), RandomHorizontalFlip, ToTensor and Normalize in a DataLoader with
  the same workers (persistent, pinned on CUDA), feeding the engine's own model, optimizer and step, timed the
  same way.

Rounds alternate the feeds, so drifts in clock speed hit all alike; the table gives medians and each feed's
img/s as a ratio to the device-resident one. The folder is generated (one class per colour, small noise) unless
``--folder`` names yours; the decoded sets are prepared by ampbench's data stage code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from ampbench import config, data, env, models
from ampbench.config import DataConfig, ModelConfig, ProfileConfig, TrainConfig
from ampbench.data import stream
from ampbench.measure.clock import synchronize
from ampbench.precision import amp_settings, names
from ampbench.runplan import RunPlan
from ampbench.train import runner, setup, step

FEEDS = ("device", "stream, memory", "stream, JPEG folder", "torchvision ImageFolder")


def make_folder(root: Path, n: int, side: int, classes: int = 10, seed: int = 0) -> None:
    """``n`` JPEGs of ``side`` x ``side`` in ``classes`` class folders."""
    rng = np.random.default_rng(seed)
    tint = rng.integers(30, 226, (classes, 3))
    for i in range(n):
        c = i % classes
        (root / f"class{c}").mkdir(parents=True, exist_ok=True)
        px = np.clip(tint[c] + rng.normal(0, 50, (side, side, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(px).save(root / f"class{c}" / f"{i:06d}.jpg", quality=90)


def plan(args, placement: str) -> RunPlan:
    return RunPlan(variant=placement, precision=args.precision, accum_steps=1, device=args.device, seed=0,
                   model=ModelConfig(arch=args.arch, channels_last=True),
                   train=TrainConfig(epochs=1, batch_size=args.batch, warmup_steps=args.warmup, augment=True),
                   amp=amp_settings(args.precision, config.AmpConfig()),
                   profile=ProfileConfig(steps=0), placement=placement,
                   workers=args.workers if placement == "stream" else 0)


def engine(args, prepared: dict, placement: str) -> dict:
    """One epoch through ampbench's engine in ``placement``: img/s and the data-wait share of its timed steps."""
    m = runner.train(plan(args, placement), prepared, progress=False, profile=False).metrics
    return {"imgs_per_s": m["imgs_per_s"], "data_share": m["data_time_fraction"]}


def torchvision_loop(args, root: Path, listed: Path, meta: dict) -> dict:
    """The same training images through torchvision's ImageFolder and transforms, the usual way, into the
    engine's own model, optimizer and step (``setup.build``, ``step.train_step``), timed as the engine's clock."""
    from torchvision import datasets, transforms
    mean, std = meta["mean"], meta["std"]
    tf = transforms.Compose([transforms.Resize((args.side, args.side)), transforms.RandomCrop(args.side, padding=4),
                             transforms.RandomHorizontalFlip(), transforms.ToTensor(), transforms.Normalize(mean, std)])
    folder = datasets.ImageFolder(str(root), transform=tf)
    train = {(root / p).resolve() for p in json.loads((listed / data.FILE_LIST).read_text())["train"]["paths"]}
    folder.samples = folder.imgs = [s for s in folder.samples if Path(s[0]).resolve() in train]  # not the test set
    loader = DataLoader(folder, batch_size=args.batch, shuffle=True, drop_last=True, num_workers=args.workers,
                        pin_memory=args.device == "cuda", persistent_workers=args.workers > 0,
                        prefetch_factor=stream.PREFETCH if args.workers else None)
    if len(loader) <= args.warmup:
        raise SystemExit(f"error: {len(folder.samples)} training images make {len(loader)} batches of {args.batch}, "
                         f"not more than the {args.warmup} warm-up steps; give more --images or a smaller --batch")
    s = setup.build(plan(args, "device"), meta, torch.device(args.device))
    waited, seen, start = 0.0, 0, None
    it = iter(loader)
    for i in range(len(loader)):
        if i == args.warmup:
            synchronize(args.device)
            start, waited = time.perf_counter(), 0.0
        t0 = time.perf_counter()
        x, y = next(it)
        x = x.to(args.device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        y = y.to(args.device, non_blocking=True)
        synchronize(args.device)
        waited += time.perf_counter() - t0
        step.train_step(s.step_model, s.opt, s.scaler, s.policy, x, y, len(y))
        synchronize(args.device)  # as the engine's clock: the step's compute ends before the next data wait
        if start is not None:
            seen += len(y)
    total = time.perf_counter() - start
    return {"imgs_per_s": seen / total, "data_share": waited / total}


def table(rows: dict, args, machine: str) -> str:
    base = statistics.median(r["imgs_per_s"] for r in rows["device"])
    lines = [f"{args.arch}, {args.precision}, batch {args.batch}, {args.images:,} images of {args.side}x{args.side} "
             f"(JPEG), {args.workers} DataLoader worker(s), {args.rounds} round(s), {machine}, torch "
             f"{torch.__version__}", "",
             "| feed | img/s (median) | vs device | data wait (share of each step) |", "|---|---|---|---|"]
    for feed in FEEDS:
        rate = statistics.median(r["imgs_per_s"] for r in rows[feed])
        share = statistics.median(r["data_share"] for r in rows[feed])
        lines.append(f"| {feed} | {rate:,.0f} | {rate / base:.2f}x | {share:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--arch", default="small_cnn", choices=list(models.ARCHS))
    ap.add_argument("--precision", default="fp32", choices=names())
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--images", type=int, default=4096, help="images to generate (ignored with --folder)")
    ap.add_argument("--side", type=int, default=32, help="image side the model sees (and the generated JPEGs')")
    ap.add_argument("--folder", help="your own ImageFolder tree instead of generated JPEGs")
    ap.add_argument("--workers", type=int, default=-1, help="DataLoader workers (-1: this process's cores)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write the table (.md) and the measurements (.json) here")
    args = ap.parse_args()
    args.workers = config.resolve_workers(args.workers, env.usable_cores(), 1)
    info = env.probe()
    machine = (info["gpu"]["name"] if info.get("gpu") and args.device == "cuda"
               else f"{info['cpu_model']}, {env.usable_cores()} cores")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root = Path(args.folder) if args.folder else tmp / "jpegs"
        if not args.folder:
            make_folder(root, args.images, args.side)
        cfg = DataConfig(source="folder", path=str(root), image_size=args.side, test_size=256)
        decoded = data.prepare(cfg, 0, tmp / "decoded", tmp / "raw")
        data.prepare(cfg, 0, tmp / "listed", tmp / "raw", form="files")
        args.images = decoded["train_count"] + decoded["test_count"]
        resident = data.load_prepared(tmp / "decoded", args.device)
        mapped = data.load_prepared(tmp / "decoded", args.device, stream=True)
        listed = data.load_prepared(tmp / "listed", args.device, stream=True)
        print(f"{args.arch}, {args.precision}, batch {args.batch}, {decoded['train_count']:,} training images, "
              f"{args.workers} worker(s), {machine}")
        rows = {feed: [] for feed in FEEDS}
        for r in range(args.rounds):
            for feed, run in ((FEEDS[0], lambda: engine(args, resident, "device")),
                              (FEEDS[1], lambda: engine(args, mapped, "stream")),
                              (FEEDS[2], lambda: engine(args, listed, "stream")),
                              (FEEDS[3], lambda: torchvision_loop(args, root, tmp / "listed", decoded))):
                rows[feed].append(run())
                print(f"round {r + 1} {feed:<24} {rows[feed][-1]['imgs_per_s']:>9,.0f} img/s, data wait "
                      f"{rows[feed][-1]['data_share']:.0%}", flush=True)
    page = table(rows, args, machine)
    print("\n" + page)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(page)
        out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "machine": machine, "rows": rows},
                                                       indent=2) + "\n")


if __name__ == "__main__":
    main()
