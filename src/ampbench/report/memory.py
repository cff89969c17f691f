"""The report's memory section: each variant's peak beside what the model holds (activations, parameters,
gradients, optimizer state, the data set), and where the optimizer's state outweighs what a precision saves."""

from __future__ import annotations

from ampbench.report import fmt
from ampbench.report.fmt import not_made


def memory(summary: dict, env: dict, runs: dict) -> list[str]:
    """Every memory meter of every variant, and what each one counts."""
    lines = ["## Memory, meter by meter", "",
             "Where each variant's memory went: the meter that measured it, its peaks, and the parts that make them.",
             "",
             "| variant | meter | peak (training) | peak reserved | first step (autotuning) | evaluation peak "
             "| activations (one micro-batch) | parameters | gradients | optimizer state | data set on the device |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary["variants"].items():
        reserved = "n/a on CPU" if r.get("mem_meter") == "process_peak_rss" else fmt.size(r.get("peak_reserved_bytes"))
        cuda_only = "n/a on CPU" if r.get("mem_meter") == "process_peak_rss" else None
        lines.append(f"| {name} | {r.get('mem_meter') or 'missing'} | {fmt.size(r['peak_mem_bytes'])} | {reserved} "
                     f"| {cuda_only or fmt.size(r.get('first_step_peak_mem_bytes'))} "
                     f"| {cuda_only or fmt.size(r.get('eval_peak_mem_bytes'))} "
                     f"| {fmt.activations(r)} | {fmt.size(r.get('param_bytes'))} "
                     f"| {fmt.size(r.get('grad_bytes'))} | {fmt.size(r.get('optimizer_state_bytes'))} "
                     f"| {fmt.size(r.get('dataset_bytes'))} |")
    return lines + [
        "", "Peak (training): on a GPU, CUDA `max_memory_allocated` over the steady-state training steps: from "
        "each process's second step (the first one autotunes cuDNN, whose workspace is its own column) to the end "
        "of each epoch's training, the counters reset with `reset_peak_memory_stats` alone; evaluation's peak is "
        "its own column. Peak reserved is what the caching allocator held at most during training: it keeps the "
        "blocks it has cached, autotuning workspace included, so it is not a steady-state figure. On a CPU, the "
        "process's peak RSS, which counts "
        "the interpreter and the data set too. Activations: bytes saved for backward, counted with "
        "saved-tensor hooks, each storage once; this is where fp16 saves memory, and it is comparable "
        "across devices (a compiled variant's, marked eager, are the eager model's: Inductor may save fewer). "
        "Parameters, gradients and the optimizer's state "
        f"({_state_kept(summary)}) stay fp32 in every variant. The data "
        "set lives on the device (uint8, padded for cropping) and is part of every variant's peak.", "",
        *not_made(summary, "activations"), *_optimizer_state_outweighs(summary)]


def _state_kept(summary: dict) -> str:
    """What the runs' optimizers keep, in their registry's words (each run's metrics.json records them)."""
    kept = dict.fromkeys(r.get("optimizer_state_kept") for r in summary["variants"].values())
    return "; ".join(k for k in kept if k) or "what the optimizer keeps per parameter"


def _optimizer_state_outweighs(summary: dict) -> list[str]:
    """Where the optimizer's fp32 state outweighs the activations a variant saves against the baseline (at the
    variant's micro-batch): why AMP can save little memory, or none, for a model with many parameters."""
    rows = summary["variants"]
    base = rows.get(summary["baseline"]) or {}
    b_act, b_micro = base.get("activation_bytes"), base.get("micro_batch_size")
    out = []
    for name, r in rows.items():
        act, micro, state = r.get("activation_bytes"), r.get("micro_batch_size"), r.get("optimizer_state_bytes")
        if name == summary["baseline"] or None in (b_act, b_micro, act, micro, state) or not b_micro:
            continue
        saved = b_act / b_micro * micro - act
        if 0 < saved < state:
            out.append(f"{name}: its optimizer state ({r.get('optimizer') or 'the optimizer'}, {fmt.size(state)}) "
                       f"outweighs the activations it saves against {summary['baseline']} ({fmt.size(saved)} per "
                       "micro-batch): for this model and batch, the precision cannot cut memory much; a larger batch "
                       "or input raises the share it can.")
    return [*out, ""] if out else []
