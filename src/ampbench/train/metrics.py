"""A run's figures, assembled from the trainer after (or when stopping) training: ``run_result(trainer)``.

Under DDP every rank calls it (it all-reduces): throughput counts all ranks' images per wall second of the
slowest rank, and peak memory is the largest rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ampbench import models, precision
from ampbench.config import optim
from ampbench.measure import flops, memory, stats
from ampbench.results.schema import Metrics


@dataclass
class RunResult:
    metrics: Metrics                                   # metrics.json (results.schema)
    history: list[dict] = field(default_factory=list)  # one row per epoch
    scale_history: list[dict] = field(default_factory=list)  # every loss-scale change: step, scale, skipped
    grad_norms: list[dict] = field(default_factory=list)  # the gradient norm before clipping: step, grad_norm
    step_times_ms: list[float] = field(default_factory=list)  # timed (post-warm-up) steps, end to end
    step_rates: list[float] = field(default_factory=list)     # the same steps' images per second
    numerics: list[dict] = field(default_factory=list)  # the fp16 audit, one row per layer
    system: list[dict] = field(default_factory=list)    # CPU/memory/GPU samples taken while training (bounded)
    system_samples: dict | None = None  # the summarized GPU readings of every sample (sysmon.SystemMonitor.samples)
    profile_trace: str = ""                             # torch.profiler's Chrome trace of the profiled steps
    weights: dict | None = None  # the trained model's state dict (on the CPU), taken before the audit and profile
    extra: dict[str, list[dict]] = field(default_factory=dict)  # further tables of results.TABLES, by key

    def tables(self) -> dict[str, list[dict]]:
        """The run folder's tables, by ``results.TABLES`` key."""
        return {"history": self.history, "scale": self.scale_history, "grad_norm": self.grad_norms,
                "numerics": self.numerics, "system": self.system, **self.extra}


def run_result(t) -> RunResult:
    """The ``RunResult`` of trainer ``t`` (an ``engine.Trainer``): metrics.json, history, series, step times."""
    plan, device, c = t.plan, t.device, t.clock
    total_e2e, total_compute, data_ms = sum(c.cycle_ms), sum(c.compute_ms), sum(c.data_ms)
    timed_images = c.timed_images  # every rank's images: the clock counts each step's global batch
    mem = memory.peak_memory(device)  # since training began; on a CPU the process's peak RSS
    phases = t.peaks.peaks  # CUDA only: "first step" (cuDNN autotuning), "train" (steady state), "eval"
    if device.type != "cuda":
        mem["peak_window"] = "the whole process"
    else:
        mem["peak_window"] = "steady-state training steps" if "train" in phases else "the first step (autotuning)"
    mem.update(phases.get("train") or phases.get("first step") or {})
    evaluation, first = phases.get("eval") or {}, phases.get("first step") or {}
    # All ranks' images per wall second of the slowest rank, and the largest rank's memory (one rank: its own).
    total_e2e, total_compute, data_ms, *peaks = t.world.reduce(
        [total_e2e, total_compute, data_ms, mem["peak_mem_bytes"], mem["peak_reserved_bytes"] or 0,
         evaluation.get("peak_mem_bytes", 0), first.get("peak_mem_bytes", 0)], "max")
    mem["peak_mem_bytes"], mem["peak_reserved_bytes"] = int(peaks[0]), int(peaks[1]) or None
    mem["eval_peak_mem_bytes"] = int(peaks[2]) or None  # CUDA only: evaluation's own peak
    mem["first_step_peak_mem_bytes"] = int(peaks[3]) or None  # CUDA only: with cuDNN's autotuning workspace
    params = list(t.model.parameters())
    last = t.history[-1] if t.history else {"eval_acc": None, "train_loss": None, "eval_loss": None}
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    ips = timed_images / (total_e2e / 1000) if total_e2e else None  # StepClock.imgs_per_s, the slowest rank's time
    rates = c.step_rates()
    rung = precision.rung(plan.precision)
    fp8_layers = t.layers_converted  # the converted layers a forward runs converted (None for the others)
    peak_prec = rung.measured_column(fp8_layers)  # an fp8 run that converted nothing ran in bf16: bf16's peak
    peak = flops.datasheet_peak(device_name if device.type == "cuda" else None, peak_prec)
    achieved = t.flops_per_image * ips / 1e12 if ips and t.flops_per_image else None
    metrics: Metrics = {
        "variant": plan.variant, "precision": plan.precision, "accum_steps": plan.accum_steps,
        "micro_batch_size": t.micro, "epochs": plan.train.epochs, "batch_size": plan.train.batch_size,
        "arch": plan.model.arch, **models.describe(t.model, plan.model), "input_size": t.input_size,
        "num_classes": t.data_meta["num_classes"], "device": plan.device, "device_name": device_name,
        "imgs_per_s": ips,  # end to end (data, compute, host work between steps), after warm-up
        "imgs_per_s_p10_p90": stats.rate_spread(rates),
        "compute_imgs_per_s": timed_images / (total_compute / 1000) if total_compute else None,
        "world_size": t.world.size, "backend": t.world.backend or None, "cpu_threads": torch.get_num_threads(),
        "strategy": plan.strategy if t.world.active else None,  # ddp | fsdp (a stopped run's too)
        "grad_comm": plan.grad_comm if t.world.active else None,
        "imgs_per_s_per_process": ips / t.world.size if ips else None,
        "step_time_ms": stats.summarize_ms(c.cycle_ms),      # end to end
        "compute_time_ms": stats.summarize_ms(c.compute_ms),  # forward, backward, optimizer step
        "data_time_ms": stats.summarize_ms(c.data_ms),
        "data_time_fraction": data_ms / total_e2e if total_e2e else None,
        "timed_steps": len(c.cycle_ms), "warmup_steps": plan.train.warmup_steps,
        "epoch_time_s": stats.percentile([r["epoch_time_s"] for r in t.history], 50) if t.history else None,
        **mem,  # under DDP: the largest of the ranks' peaks
        "activation_bytes": t.activation_bytes,
        "param_bytes": memory.tensor_bytes(params),
        "grad_bytes": memory.tensor_bytes(p for p in params if p.requires_grad),  # one per trained parameter
        "optimizer_state_bytes": memory.optimizer_state_bytes(t.opt),
        "dataset_bytes": t.train_batches.nbytes + t.test_batches.nbytes,
        "final_acc": last["eval_acc"], "best_acc": t.best_acc, "final_loss": last["train_loss"],
        "final_eval_loss": last["eval_loss"], "final_loss_scale": t.ledger.last_scale,
        "skipped_steps": t.ledger.skipped, "nonfinite_loss_steps": t.ledger.nonfinite_steps,
        "optimizer_steps": t.global_step, "accum_grad_max_rel_diff": t.accum_check,
        "train_flops_per_image": t.flops_per_image,  # forward + backward, torch.utils.flop_counter
        "achieved_tflops": achieved, "peak_tflops_datasheet": peak, "peak_precision": peak_prec,
        "fraction_of_peak": achieved / peak if achieved and peak else None,
        "tf32": t.tf32, "compiled": plan.train.compile, "augment": plan.train.augment,
        "torch": torch.__version__, "train_images": t.counts[0], "test_images": t.counts[1],
        "train_images_per_epoch": t.train_batches.used,  # the last partial batch is dropped
        "data_source": t.data_meta["source"],
        "data_placement": plan.placement,  # device: resident there; stream: DataLoader workers from host memory
        "data_workers": plan.workers if plan.placement == "stream" else None,
        "fp8_recipe": plan.recipe,  # a converting rung (fp8, mxfp8): its recipe, and the layers it converted
        "fp8_layers": fp8_layers,
        "optimizer": plan.train.optimizer, "optimizer_impl": plan.train.optimizer_impl,
        "optimizer_state_kept": optim.info(plan.train.optimizer).state_words,  # the report's words for its state
        "clip_grad_norm": plan.train.clip_grad_norm or None,
        "grad_norm_logged": t.log_norms,  # one norm per timed step too: part of what was timed
    }
    if not c.cycle_ms:
        metrics["timing_note"] = (f"no step was timed: every step fell within train.warmup_steps = "
                                  f"{plan.train.warmup_steps}")
    return RunResult(metrics=metrics, history=t.history, scale_history=t.ledger.scale_history,
                     grad_norms=t.ledger.grad_norms, step_times_ms=c.cycle_ms, step_rates=rates)
