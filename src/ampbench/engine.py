"""The one training loop, and evaluation. Every variant runs this code.

Variants differ only in data passed in: the precision policy (autocast dtype,
GradScaler) and ``accum_steps``. ``train(plan, data)`` returns a ``RunResult``;
writing it to disk is the caller's job (see ``results.py``).

    python stages/train.py --variant amp ...   # what DVC runs for train@amp
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ampbench import flops, measure, models
from ampbench.config import RunPlan
from ampbench.data import DeviceBatches
from ampbench.env import set_tf32
from ampbench.precision import PrecisionPolicy, micro_batch_size


@dataclass
class RunResult:
    metrics: dict                                      # one flat-ish dict: metrics.json
    history: list[dict] = field(default_factory=list)  # one row per epoch
    scale_history: list[dict] = field(default_factory=list)  # every loss-scale change: step, scale, skipped
    step_times_ms: list[float] = field(default_factory=list)  # timed (post-warm-up) steps, end to end


def lr_lambda(total_steps: int):
    """Linear warm-up over the first 5% of optimizer steps, then cosine decay to zero."""
    warm = max(1, round(0.05 * total_steps))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def accumulate_gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int,
                         policy: PrecisionPolicy, scaler: torch.amp.GradScaler) -> torch.Tensor:
    """Forward and backward ``x`` in micro-batches of ``micro``; return the batch's mean loss (on the device).

    Each micro-batch's mean loss is weighted by its share of the batch, so the
    summed gradients equal those of one full-batch step (for a short last
    micro-batch too). With accum_steps = 4 that is the article's "divide the
    loss by accum_steps".
    """
    n = len(y)
    total = torch.zeros((), device=x.device)
    for xs, ys in zip(x.split(micro), y.split(micro), strict=True):
        with policy.autocast():
            out = model(xs)
            loss = F.cross_entropy(out, ys) * (len(ys) / n)
        scaler.scale(loss).backward()  # scaled (fp16) so small gradients do not flush to zero
        total += loss.detach().float()
    return total


def make_batches(plan: RunPlan, data: dict) -> tuple[DeviceBatches, DeviceBatches]:
    meta = data["meta"]
    common = dict(mean=meta["mean"], std=meta["std"], channels_last=plan.model.channels_last)
    train = DeviceBatches(*data["train"], plan.train.batch_size, augment=True, shuffle=True,
                          seed=plan.seed, **common)
    test = DeviceBatches(*data["test"], plan.train.eval_batch_size, augment=False, shuffle=False, **common)
    return train, test


def evaluate(model: torch.nn.Module, batches: DeviceBatches, policy: PrecisionPolicy) -> dict:
    """Accuracy and mean loss over the evaluation set, in the variant's precision."""
    model.eval()
    dev = batches.device
    loss_sum = torch.zeros((), device=dev)
    correct = torch.zeros((), device=dev, dtype=torch.int64)
    n = 0
    with torch.no_grad(), policy.autocast():
        for x, y in batches.epoch(0):
            out = model(x)
            loss_sum += F.cross_entropy(out.float(), y, reduction="sum")
            correct += (out.argmax(dim=1) == y).sum()
            n += len(y)
    model.train()
    return {"acc": correct.item() / max(1, n), "loss": loss_sum.item() / max(1, n)}  # one sync per evaluation


def activation_bytes(model: torch.nn.Module, x: torch.Tensor, policy: PrecisionPolicy) -> int:
    """Bytes autograd saves for backward in one forward pass of ``x`` (on a copy, so BN stats stay put)."""
    probe = copy.deepcopy(model).train()
    meter = measure.SavedTensorMeter()
    with meter.measure(), policy.autocast():
        out = probe(x)
    del out, probe
    return meter.bytes


def train(plan: RunPlan, data: dict, *, progress: bool = True) -> RunResult:
    """Train one variant for ``plan.train.epochs`` epochs and measure it."""
    torch.manual_seed(plan.seed)
    device = torch.device(plan.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # pick the fastest conv kernels for our fixed shapes
    tf32 = set_tf32(plan.train.allow_tf32)
    policy = PrecisionPolicy(plan.precision, device.type, plan.amp)
    model = models.build(plan.model.arch, channels_last=plan.model.channels_last, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=plan.train.lr, momentum=plan.train.momentum,
                          weight_decay=plan.train.weight_decay, nesterov=True)
    scaler = policy.scaler()
    train_batches, test_batches = make_batches(plan, data)
    steps_per_epoch = len(train_batches)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(plan.train.epochs * steps_per_epoch))
    micro = micro_batch_size(plan.train.batch_size, plan.accum_steps)

    first_x, first_y = next(train_batches.epoch(0))
    act_bytes = activation_bytes(model, first_x[:micro], policy)
    flops_per_image = flops.train_flops_per_image(model, first_x[:8], first_y[:8])  # per image: 8 suffice
    step_model = torch.compile(model) if plan.train.compile else model
    measure.reset_peak_memory(device)

    step_timer, data_timer = measure.StepTimer(device), measure.StepTimer(device)
    result = RunResult(metrics={})
    step_ms: list[float] = []
    data_ms: list[float] = []
    timed_images = 0
    skipped = 0
    last_scale = scaler.get_scale() if policy.uses_scaler else None
    if policy.uses_scaler:
        result.scale_history.append({"step": 0, "scale": last_scale, "skipped": False})
    best_acc = 0.0
    global_step = 0
    t_start = time.perf_counter()
    total_steps = plan.train.epochs * steps_per_epoch

    for epoch in range(plan.train.epochs):
        loss_sum = torch.zeros((), device=device)  # summed on the device: no per-step sync
        seen = 0
        epoch_first_step = global_step
        batch_sizes = []
        bar = tqdm(total=steps_per_epoch, disable=not progress, unit="step", dynamic_ncols=True,
                   desc=f"{plan.variant} epoch {epoch + 1}/{plan.train.epochs}")
        batches = train_batches.epoch(epoch)
        with measure.wall_clock(device) as clock:
            for _ in range(steps_per_epoch):
                data_timer.start()
                x, y = next(batches)
                data_timer.stop()
                step_timer.start()
                n = len(y)
                opt.zero_grad(set_to_none=True)
                loss_sum += accumulate_gradients(step_model, x, y, micro, policy, scaler) * n
                scaler.step(opt)  # unscales, and skips the update if any gradient is inf/NaN
                scaler.update()   # once per optimizer step, not per micro-batch
                step_timer.stop()
                if policy.uses_scaler:
                    # scaler.step already synced to check for inf; reading the scale costs nothing more.
                    scale = scaler.get_scale()
                    was_skipped = scale < last_scale  # the scale only drops on an overflow
                    if scale != last_scale:
                        result.scale_history.append({"step": global_step + 1, "scale": scale,
                                                     "skipped": was_skipped})
                    last_scale = scale
                else:
                    was_skipped = False
                if was_skipped:
                    skipped += 1  # the weights did not change, so neither does the LR schedule
                else:
                    sched.step()
                seen += n
                batch_sizes.append(n)
                global_step += 1
                bar.update(1)
                if progress and (global_step % 25 == 0 or global_step == epoch_first_step + steps_per_epoch):
                    bar.set_postfix(loss=f"{loss_sum.item() / seen:.3f}", lr=f"{sched.get_last_lr()[0]:.3g}")
        bar.close()

        # Times of this epoch's steps; the first warmup_steps of the run are excluded.
        ep_step, ep_data = step_timer.read_ms(), data_timer.read_ms()
        keep = [i for i in range(len(ep_step)) if epoch_first_step + i >= plan.train.warmup_steps]
        step_ms += [ep_step[i] for i in keep]
        data_ms += [ep_data[i] for i in keep]
        ep_images = sum(batch_sizes[i] for i in keep)
        timed_images += ep_images
        ep_time = sum(ep_step[i] + ep_data[i] for i in keep)
        ev = evaluate(model, test_batches, policy)
        best_acc = max(best_acc, ev["acc"])
        row = {"epoch": epoch + 1, "train_loss": loss_sum.item() / max(1, seen), "eval_loss": ev["loss"],
               "eval_acc": ev["acc"], "lr": sched.get_last_lr()[0], "loss_scale": last_scale,
               "skipped_steps": skipped, "epoch_time_s": clock["s"],
               "imgs_per_s": ep_images / (ep_time / 1000) if ep_time else None}
        result.history.append(row)
        if progress:
            elapsed = time.perf_counter() - t_start
            eta = elapsed / global_step * (total_steps - global_step)
            ips = f"{row['imgs_per_s']:.0f}" if row["imgs_per_s"] else "n/a (warm-up)"
            tqdm.write(f"[{plan.variant}] epoch {epoch + 1}/{plan.train.epochs}: train loss "
                       f"{row['train_loss']:.4f}, eval acc {ev['acc']:.4f}, {ips} img/s, "
                       f"{clock['s']:.1f}s, ETA {eta:.0f}s")

    e2e_ms = [a + b for a, b in zip(step_ms, data_ms, strict=True)]
    total_e2e, total_compute = sum(e2e_ms), sum(step_ms)
    mem = measure.peak_memory(device)
    params = list(model.parameters())
    step_stats = measure.summarize_ms(step_ms)
    result.step_times_ms = e2e_ms
    result.metrics = {
        "variant": plan.variant, "precision": plan.precision, "accum_steps": plan.accum_steps,
        "micro_batch_size": micro, "epochs": plan.train.epochs, "batch_size": plan.train.batch_size,
        "arch": plan.model.arch, "device": plan.device,
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "imgs_per_s": timed_images / (total_e2e / 1000) if total_e2e else None,
        "compute_imgs_per_s": timed_images / (total_compute / 1000) if total_compute else None,
        "step_time_ms": measure.summarize_ms(e2e_ms),      # data + compute: what the report compares
        "compute_time_ms": step_stats,                      # forward, backward and optimizer step only
        "data_time_ms": measure.summarize_ms(data_ms),
        "data_time_fraction": sum(data_ms) / total_e2e if total_e2e else None,
        "timed_steps": len(step_ms), "warmup_steps": plan.train.warmup_steps,
        "epoch_time_s": measure.percentile([r["epoch_time_s"] for r in result.history], 50),
        **mem,
        "activation_bytes": act_bytes,
        "param_bytes": measure.tensor_bytes(params),
        "grad_bytes": measure.tensor_bytes(p for p in params),  # one grad per parameter, same dtype
        "optimizer_state_bytes": measure.optimizer_state_bytes(opt),
        "final_acc": result.history[-1]["eval_acc"], "best_acc": best_acc,
        "final_loss": result.history[-1]["train_loss"], "final_eval_loss": result.history[-1]["eval_loss"],
        "final_loss_scale": last_scale, "skipped_steps": skipped, "optimizer_steps": global_step,
        "tf32": tf32, "torch": torch.__version__,
        "train_images": len(data["train"][1]), "test_images": len(data["test"][1]),
        "data_source": data["meta"]["source"],
    }
    ips, peak_prec = result.metrics["imgs_per_s"], flops.peak_precision(plan.precision, plan.train.allow_tf32)
    peak = flops.datasheet_peak(result.metrics["device_name"] if device.type == "cuda" else None, peak_prec)
    achieved = flops_per_image * ips / 1e12 if ips else None
    result.metrics.update({
        "train_flops_per_image": flops_per_image,            # forward + backward, torch.utils.flop_counter
        "achieved_tflops": achieved,                         # end to end, after warm-up
        "peak_tflops_datasheet": peak, "peak_precision": peak_prec,
        "fraction_of_peak": achieved / peak if achieved and peak else None,
        "compiled": plan.train.compile,
    })
    if step_stats["n"] == 0:
        result.metrics["timing_note"] = (f"no step was timed: all {global_step} steps fell within "
                                         f"train.warmup_steps = {plan.train.warmup_steps}")
    return result


REPEATED = ("imgs_per_s", "compute_imgs_per_s", "final_acc", "best_acc", "final_loss", "achieved_tflops",
            "epoch_time_s")


def train_repeats(plan: RunPlan, data: dict, *, progress: bool = True) -> RunResult:
    """Train ``plan.train.repeats`` times with seeds seed, seed+1, ...; mean and spread across them.

    The first repeat's history is the run's history; step times are pooled.
    """
    runs = []
    for i in range(plan.train.repeats):
        if progress and plan.train.repeats > 1:
            tqdm.write(f"[{plan.variant}] repeat {i + 1}/{plan.train.repeats} (seed {plan.seed + i})")
        runs.append(train(dataclasses.replace(plan, seed=plan.seed + i), data, progress=progress))
    out = RunResult(metrics=dict(runs[0].metrics), history=runs[0].history, scale_history=runs[0].scale_history,
                    step_times_ms=[t for r in runs for t in r.step_times_ms])
    m = out.metrics
    for key in REPEATED:
        values = [r.metrics[key] for r in runs if r.metrics.get(key) is not None]
        mean, std = measure.mean_std(values) if values else (None, None)
        m[key], m[f"{key}_std"], m[f"{key}_runs"] = mean, (std if len(values) > 1 else None), values
    m["repeats"] = len(runs)
    m["seeds"] = [plan.seed + i for i in range(len(runs))]
    m["skipped_steps"] = sum(r.metrics["skipped_steps"] for r in runs)
    m["step_time_ms"] = measure.summarize_ms(out.step_times_ms)
    for key in ("peak_mem_bytes", "peak_reserved_bytes"):
        values = [r.metrics[key] for r in runs if r.metrics.get(key) is not None]
        m[key] = max(values) if values else None
    return out
