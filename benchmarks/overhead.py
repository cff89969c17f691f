"""Overhead: the article's plain training loop against ampbench's engine, side by side in one process.

    python benchmarks/overhead.py                       # small CNN, fp32, CPU: the target is ratio >= 1.0
    python benchmarks/overhead.py --device cuda --arch resnet18 --batch 256 --precision fp16

Both train the same model (same initial weights) on the same synthetic images with the same batch and
precision. The plain loop is the article's: a torch DataLoader over the (pre-normalised) tensors, then
autocast, GradScaler.scale/step/update, with no augmentation; ampbench's engine keeps the data on the
device and also augments it (crop, flip). Rounds alternate the two; each reports img/s after the warm-up
steps, data loading included. The ratio is ampbench / plain. Exit status 1 if the median ratio is below
--target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ampbench import config, data, engine, models
from ampbench.config import MlflowConfig, ModelConfig, RunPlan, TrainConfig
from ampbench.measure import synchronize
from ampbench.precision import DTYPES


def plain_loop(arch: str, channels_last: bool, images: torch.Tensor, labels: torch.Tensor, batch: int,
               precision: str, device: str, warmup: int, seed: int) -> float:
    """The article's loop (with today's torch.amp names); img/s after ``warmup`` steps."""
    torch.manual_seed(seed)
    model = models.build(arch, channels_last=channels_last, device=device)
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
    ap.add_argument("--images", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target", type=float, default=1.0)
    args = ap.parse_args()

    prepared = data.synthetic_in_memory(args.images, 256, seed=0, device=args.device)
    x_u8, y = prepared["train"]
    mean = torch.tensor(prepared["meta"]["mean"], device=args.device).view(1, 3, 1, 1)
    std = torch.tensor(prepared["meta"]["std"], device=args.device).view(1, 3, 1, 1)
    x_float = ((x_u8.float() / 255 - mean) / std).cpu()  # what a DataLoader pipeline would hand the model
    plan = RunPlan(variant="engine", precision=args.precision, accum_steps=1, device=args.device, seed=0,
                   model=ModelConfig(arch=args.arch, channels_last=True),
                   train=TrainConfig(epochs=1, batch_size=args.batch, warmup_steps=args.warmup),
                   amp=config.AmpConfig() if args.precision == "fp16" else None, mlflow=MlflowConfig(enabled=False))

    print(f"{args.arch}, {args.precision}, batch {args.batch}, {args.images} images, {args.device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'round':>5} {'plain img/s':>12} {'ampbench img/s':>15} {'ratio':>7} {'data share':>11}")
    ratios, data_shares = [], []
    for r in range(args.rounds):
        plain = plain_loop(args.arch, True, x_float, y.cpu(), args.batch, args.precision, args.device,
                           args.warmup, seed=r)
        m = engine.train(plan, prepared, progress=False).metrics
        ratios.append(m["imgs_per_s"] / plain)
        data_shares.append(m["data_time_fraction"])
        print(f"{r + 1:>5} {plain:>12,.0f} {m['imgs_per_s']:>15,.0f} {ratios[-1]:>7.3f} {data_shares[-1]:>10.1%}")
    med = statistics.median(ratios)
    print(f"ratio ampbench/plain: median {med:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) over "
          f"{len(ratios)} rounds; ampbench data time {statistics.median(data_shares):.1%} of step time")
    ok = med >= args.target and statistics.median(data_shares) < 0.05
    print(f"target (ratio >= {args.target}, data time < 5%): {'met' if ok else 'NOT met'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
