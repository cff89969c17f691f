"""Overhead: the article's plain training loop against ampbench's engine, side by side in one process.

    python benchmarks/overhead.py                       # small CNN, fp32, CPU: the target is ratio >= 1.0
    python benchmarks/overhead.py --device cuda --arch resnet18 --batch 256 --precision fp16

Both train the same model (same initial weights) on the same synthetic images with the same batch and
precision. The plain loop is the article's: a torch DataLoader over the (pre-normalised) tensors, then
autocast, GradScaler.scale/step/update, with no augmentation. ampbench's engine runs twice per round:
without augmentation (like for like: the ratio measures the engine's own overhead, and the target applies
to it) and with its on-device crop and flip (what `dvc repro` runs). Each reports img/s after the warm-up
steps, data loading included. Exit status 1 if the like-for-like median ratio is below --target or the
engine's data time is 5% of its step time or more.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ampbench import config, data, models, runner
from ampbench.config import MlflowConfig, ModelConfig, RunPlan, TrainConfig
from ampbench.measure import synchronize
from ampbench.precision import DTYPES


def plain_loop(arch: str, channels_last: bool, images: torch.Tensor, labels: torch.Tensor, batch: int,
               precision: str, device: str, warmup: int, seed: int) -> float:
    """The article's loop (with today's torch.amp names); img/s after ``warmup`` steps."""
    torch.manual_seed(seed)
    model = models.build(ModelConfig(arch=arch, channels_last=channels_last), num_classes=10, image_size=32,
                         device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)
    scaler = torch.amp.GradScaler(device, enabled=precision == "fp16")
    loader = DataLoader(TensorDataset(images, labels), batch_size=batch, shuffle=True)
    seen, start = 0, None
    for step, (x, y) in enumerate(loader):
        if step == warmup:
            synchronize(device)
            start = time.perf_counter()
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        with torch.autocast(device, dtype=DTYPES[precision], enabled=precision != "fp32"):
            outputs = model(x)
            loss = F.cross_entropy(outputs, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if start is not None:
            seen += len(y)
    synchronize(device)
    return seen / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--arch", default="small_cnn", choices=list(models.ARCHS))
    ap.add_argument("--precision", default="fp32", choices=list(DTYPES))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--images", type=int, default=16384)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--target", type=float, default=1.0)
    args = ap.parse_args()

    prepared = data.synthetic_in_memory(args.images, 256, seed=0, device=args.device)
    x_u8, y = prepared["train"]
    mean = torch.tensor(prepared["meta"]["mean"], device=args.device).view(1, 3, 1, 1)
    std = torch.tensor(prepared["meta"]["std"], device=args.device).view(1, 3, 1, 1)
    x_float = ((x_u8.float() / 255 - mean) / std).cpu()  # what a DataLoader pipeline would hand the model
    def plan(augment: bool) -> RunPlan:
        return RunPlan(variant="engine", precision=args.precision, accum_steps=1, device=args.device, seed=0,
                       model=ModelConfig(arch=args.arch, channels_last=True),
                       train=TrainConfig(epochs=1, batch_size=args.batch, warmup_steps=args.warmup, augment=augment),
                       amp=config.AmpConfig() if args.precision == "fp16" else None,
                       mlflow=MlflowConfig(enabled=False))

    print(f"{args.arch}, {args.precision}, batch {args.batch}, {args.images} images, {args.device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'round':>5} {'plain':>8} {'ampbench':>9} {'ratio':>6} {'data':>6} {'+augment':>9} {'ratio':>6} "
          f"{'data':>6}   (img/s; data = share of step time)")
    ratios, aug_ratios, shares, aug_shares = [], [], [], []
    for r in range(args.rounds):
        plain = plain_loop(args.arch, True, x_float, y.cpu(), args.batch, args.precision, args.device,
                           args.warmup, seed=r)
        same = runner.train(plan(False), prepared, progress=False).metrics
        aug = runner.train(plan(True), prepared, progress=False).metrics
        ratios.append(same["imgs_per_s"] / plain)
        aug_ratios.append(aug["imgs_per_s"] / plain)
        shares.append(same["data_time_fraction"])
        aug_shares.append(aug["data_time_fraction"])
        print(f"{r + 1:>5} {plain:>8,.0f} {same['imgs_per_s']:>9,.0f} {ratios[-1]:>6.3f} {shares[-1]:>6.1%} "
              f"{aug['imgs_per_s']:>9,.0f} {aug_ratios[-1]:>6.3f} {aug_shares[-1]:>6.1%}")
    med, share = statistics.median(ratios), statistics.median(shares)
    print(f"ampbench/plain, like for like: median {med:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) over "
          f"{len(ratios)} rounds; data time {share:.1%} of step time")
    print(f"ampbench with augmentation/plain without: median {statistics.median(aug_ratios):.3f}; "
          f"data time {statistics.median(aug_shares):.1%} of step time")
    ok = med >= args.target and share < 0.05
    print(f"target (like-for-like ratio >= {args.target}, data time < 5%): {'met' if ok else 'NOT met'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
