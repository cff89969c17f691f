"""Overhead: ampbench's engine against two plain training loops, side by side in one process.

    python benchmarks/overhead.py                       # small CNN, fp32, CPU: the target is ampbench/fastest >= 1.0
    python benchmarks/overhead.py --device cuda --arch resnet18 --batch 256 --precision fp16
    python benchmarks/overhead.py --host                # host work per step, part by part (benchmarks/host.py)

All train the same model (same initial weights) on the same synthetic images with the same batch and
precision. Two baselines:

- the article's loop: a torch DataLoader over the (pre-normalised) tensors, then autocast,
  GradScaler.scale/step/update, with no augmentation;
- the fastest honest plain loop: the pre-normalised images already on the device (channels_last), each
  epoch indexed by a random permutation, and PyTorch's AMP recipe step; nothing else.

ampbench's engine runs twice per round: without augmentation (like for like: the ratios measure the
engine's own overhead, and the target applies to the fastest loop) and with its on-device crop and flip
(what `dvc repro` runs). Each reports img/s after the warm-up steps, data included. The fastest loop also runs
twice per round, and its ratio to itself (A/A) is the noise floor a ratio is read against: identical work
whose median and spread say what this machine's drift alone gives. Each round runs the loops in an order of its
own (a seeded shuffle: no loop always follows the same other). The process keeps the memory a loop frees
(benchmarks/heap.py: glibc's malloc told so before any loop, ``--glibc-defaults`` not), so no loop pays for page
faults that the loops before it caused; the minor page faults of each loop's run are printed. Exit status 1 if the
engine's like-for-like median ratio to the fastest loop is below --target, or its data time is 5% of its step
time or more.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ampbench import config, data, models
from ampbench.config import ModelConfig, ProfileConfig, TrainConfig
from ampbench.measure.clock import synchronize
from ampbench.precision import amp_settings, names, rung
from ampbench.runplan import RunPlan
from ampbench.train import runner
from ampbench.train.policy import dtype


def recipe_loop(batches, arch: str, channels_last: bool, precision: str, device: str, warmup: int,
                seed: int) -> float:
    """PyTorch's AMP recipe over ``batches`` (autocast, GradScaler scale/step/update); img/s after ``warmup``."""
    torch.manual_seed(seed)
    model = models.build(ModelConfig(arch=arch, channels_last=channels_last), num_classes=10, image_size=32,
                         device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)
    scaler = torch.amp.GradScaler(device, enabled=rung(precision).grad_scaler)
    seen, start = 0, None
    for step, (x, y) in enumerate(batches):  # the batches' own work (loading, indexing) is timed too
        if step == warmup:
            synchronize(device)
            start = time.perf_counter()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)  # a no-op when already there
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype(precision), enabled=rung(precision).autocast is not None):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if start is not None:
            seen += len(y)
    synchronize(device)
    return seen / (time.perf_counter() - start)


def plain_loop(arch: str, images: torch.Tensor, labels: torch.Tensor, batch: int, precision: str, device: str,
               warmup: int, seed: int) -> float:
    """The article's loop (with today's torch.amp names): a DataLoader over CPU tensors, copied per batch."""
    torch.manual_seed(seed)
    loader = DataLoader(TensorDataset(images, labels), batch_size=batch, shuffle=True)
    return recipe_loop(loader, arch, True, precision, device, warmup, seed)


def fastest_loop(arch: str, images: torch.Tensor, labels: torch.Tensor, batch: int, precision: str, device: str,
                 warmup: int, seed: int) -> float:
    """Pre-normalised tensors already on the device (channels_last), indexed by a random permutation."""
    torch.manual_seed(seed)
    x_all = images.to(device).contiguous(memory_format=torch.channels_last)
    y_all = labels.to(device)
    order = torch.randperm(len(y_all), device=device)
    batches = ((x_all[idx], y_all[idx]) for idx in order.split(batch))
    return recipe_loop(batches, arch, True, precision, device, warmup, seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--arch", default="small_cnn", choices=list(models.ARCHS))
    ap.add_argument("--precision", default="fp32", choices=names())
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--images", type=int, default=16384)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--target", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: its default); 1 is steadier on "
                                                          "a small shared machine, where two threads meet neighbours")
    ap.add_argument("--host", action="store_true", help="host work per step: a model of a few microseconds, the "
                    "engine against the recipe's step, part by part, fp32 and fp16 (benchmarks/host.py)")
    ap.add_argument("--glibc-defaults", action="store_true", help="leave glibc's malloc as it is (memory freed "
                    "by a loop given back to the kernel, and faulted in again by a later one)")
    args = ap.parse_args()
    import heap
    malloc = "glibc's defaults" if args.glibc_defaults else heap.keep_freed_memory()
    if args.host:
        import host

        from ampbench.train import distributed
        torch.set_num_threads(1)  # all of a step's work on the thread whose CPU time is measured
        world = distributed.init("gloo", args.device)  # under torchrun: its ranks; else one process
        batch = 4 * world.size  # a handful of images on each rank
        found = host.run(["fp32", "fp16"], args.rounds, batch=batch, images=400 * batch, device=args.device,
                         world=world)
        if world.main:
            print(f"heap: {malloc}")
            print("\n".join(host.report(found, batch, args.device, world)))
        distributed.shutdown()
        return
    if args.threads < 0:
        ap.error(f"--threads {args.threads}: give 1 or more threads, or 0 for torch's default")
    if args.threads:
        torch.set_num_threads(args.threads)

    prepared = data.synthetic_in_memory(args.images, 256, seed=0, device=args.device)
    x_u8, y = prepared["train"]
    mean = torch.tensor(prepared["meta"]["mean"], device=args.device).view(1, 3, 1, 1)
    std = torch.tensor(prepared["meta"]["std"], device=args.device).view(1, 3, 1, 1)
    x_float = ((x_u8.float() / 255 - mean) / std).cpu()  # what a DataLoader pipeline would hand the model
    def plan(augment: bool) -> RunPlan:
        return RunPlan(variant="engine", precision=args.precision, accum_steps=1, device=args.device, seed=0,
                       model=ModelConfig(arch=args.arch, channels_last=True),
                       train=TrainConfig(epochs=1, batch_size=args.batch, warmup_steps=args.warmup, augment=augment),
                       amp=amp_settings(args.precision, config.AmpConfig()),
                       profile=ProfileConfig(steps=0))

    print(f"{args.arch}, {args.precision}, batch {args.batch}, {args.images} images, {args.device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; heap: {malloc}")
    print(f"{'round':>5} {'article':>8} {'fastest':>8} {'ampbench':>9} {'/article':>8} {'/fastest':>8} {'data':>6} "
          f"{'+augment':>9} {'/fastest':>8} {'A/A':>6}   (img/s; data = share of the engine's step time; A/A = the "
          "fastest loop's second run over its first)")
    vs_article, vs_fast, aug_vs_fast, shares, aug_shares, aa = [], [], [], [], [], []
    loops = {
        "article": lambda r: plain_loop(args.arch, x_float, y.cpu(), args.batch, args.precision, args.device,
                                        args.warmup, seed=r),
        "fast": lambda r: fastest_loop(args.arch, x_float, y, args.batch, args.precision, args.device, args.warmup,
                                       seed=r),
        "fast again": lambda r: fastest_loop(args.arch, x_float, y, args.batch, args.precision, args.device,
                                             args.warmup, seed=r),
        "same": lambda r: runner.train(plan(False), prepared, progress=False).metrics,
        "aug": lambda r: runner.train(plan(True), prepared, progress=False).metrics}
    shuffle = random.Random(0)
    faults: dict[str, list[int]] = {name: [] for name in loops}  # minor page faults of each loop's run

    def run(name: str, r: int):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        try:
            return loops[name](r)
        finally:
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    for r in range(args.rounds):
        # each round in an order of its own, so a drift in clock speed over a round (a turbo budget, a neighbour)
        # favours no loop, and no loop always runs after the same other (a rotation would keep that)
        order = shuffle.sample(list(loops), len(loops))
        got = {name: run(name, r) for name in order}
        article, fast, same, aug = got["article"], got["fast"], got["same"], got["aug"]
        vs_article.append(same["imgs_per_s"] / article)
        vs_fast.append(same["imgs_per_s"] / fast)
        aug_vs_fast.append(aug["imgs_per_s"] / fast)
        shares.append(same["data_time_fraction"])
        aug_shares.append(aug["data_time_fraction"])
        aa.append(got["fast again"] / fast)
        print(f"{r + 1:>5} {article:>8,.0f} {fast:>8,.0f} {same['imgs_per_s']:>9,.0f} {vs_article[-1]:>8.3f} "
              f"{vs_fast[-1]:>8.3f} {shares[-1]:>6.1%} {aug['imgs_per_s']:>9,.0f} {aug_vs_fast[-1]:>8.3f} "
              f"{aa[-1]:>6.3f}")
    med, share = statistics.median(vs_fast), statistics.median(shares)
    print(f"ampbench/article's loop, like for like: median {statistics.median(vs_article):.3f} "
          f"(min {min(vs_article):.3f}, max {max(vs_article):.3f}) over {len(vs_article)} rounds")
    print(f"ampbench/fastest plain loop, like for like: median {med:.3f} (min {min(vs_fast):.3f}, "
          f"max {max(vs_fast):.3f}); data time {share:.1%} of step time")
    print(f"ampbench with augmentation/fastest loop without: median {statistics.median(aug_vs_fast):.3f}; "
          f"data time {statistics.median(aug_shares):.1%} of step time")
    print(f"the fastest loop against itself (A/A, the noise floor): median {statistics.median(aa):.3f} "
          f"(min {min(aa):.3f}, max {max(aa):.3f})")
    print("minor page faults per run, median (max): " + ", ".join(
        f"{name} {statistics.median(v):,.0f} ({max(v):,})" for name, v in faults.items()))
    ok = med >= args.target and share < 0.05
    print(f"target (ampbench/fastest >= {args.target}, data time < 5%): {'met' if ok else 'NOT met'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
