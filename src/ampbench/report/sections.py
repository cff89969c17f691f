"""report.md, section by section. Each section is one function ``(summary, env, runs) -> lines``, and
``SECTIONS`` lists them in the report's order: a new section is one function and one line there.

``summary`` is what ``report.summary.summarize`` computed (plus the figures drawn and the params changed),
``env`` is env.json, ``runs`` the run folders as ``results.read_runs`` reads them. Every number comes from
them; the only ones that do not are the article's, quoted and labelled as such.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from ampbench import precision
from ampbench.errors import ANALYSES
from ampbench.report import fmt
from ampbench.report.scale import scaling, sweep
from ampbench.report.summary import profile_categories
from ampbench.report.verdict import paragraph, why

# The article's own measurement (ResNet-18, CIFAR-10, batch 256, CUDA 12.1, "NVIDIA 5090 (24GB)"): quoted, not ours.
ARTICLE = {
    "hardware": 'the article\'s "NVIDIA 5090 (24GB)", CUDA 12.1, ResNet-18, CIFAR-10, batch 256',
    "rows": [
        {"precision": "FP32", "memory": "18.7 GB", "imgs_per_s": "1,200", "epoch": "3m21s"},
        {"precision": "FP16", "memory": "9.2 GB", "imgs_per_s": "3,800", "epoch": "1m02s"},
    ],
    "speedup": "3.2x", "memory_change": "-51%",
}


def model_line(m: dict) -> str:
    """Model <name> (<n> parameters, <s>x<s> inputs), <k> classes of <data> (<n> train / <n> test images)."""
    params = f"{m['param_count']:,} parameters, " if m.get("param_count") else ""
    size = f"{m['input_size']}x{m['input_size']} inputs" if m.get("input_size") else "CIFAR-sized inputs"
    classes = f"{m['num_classes']} classes of " if m.get("num_classes") else ""
    return (f"Model {m.get('model') or m.get('arch')} ({params}{size}), {classes}{m.get('data_source')} data "
            f"({m.get('train_images')} train / {m.get('test_images')} test images)")


def _first(runs: dict[str, dict]) -> dict:
    return next(iter(runs.values()))["metrics"] if runs else {}


def _speedup(row: dict) -> str:
    if row.get("speedup") is None:
        return "n/a"
    lo, hi = row.get("speedup_ci95") or [None, None]
    ci = f" ({fmt.ratio(lo)} to {fmt.ratio(hi)})" if lo is not None and hi is not None else ""
    return f"{fmt.times(row['speedup'])}{ci}"


def _imgs_per_s(r: dict) -> str:
    spread = r.get("imgs_per_s_p10_p90")
    extra = f" ({spread[0]:,.0f} to {spread[1]:,.0f})" if spread else ""
    if r.get("imgs_per_s_std") is not None:
        extra += f" ±{r['imgs_per_s_std']:,.0f} sd over {r['repeats']} repeats"
    return fmt.num(r["imgs_per_s"], ",.0f") + extra


def _tflops(r: dict) -> str:
    if r.get("achieved_tflops") is None:
        return "missing"
    frac = r.get("fraction_of_peak")
    of_peak = f" ({frac:.0%} of {r['peak_tflops_datasheet']:g} {r['peak_precision']} peak)" if frac else ""
    return f"{r['achieved_tflops']:.3g}{of_peak}"


def _accuracy(r: dict) -> str:
    sd = f" ±{r['final_acc_std'] * 100:.2f}" if r.get("final_acc_std") is not None else ""
    return fmt.num(r["final_acc"], ".2%") + sd


def not_made(summary: dict, *analyses: str) -> list[str]:
    """One line per variant for which an analysis could not be made, with why (``errors.analysis``)."""
    lines = [f"{ANALYSES[a][0].upper()}{ANALYSES[a][1:]} could not be made for `{n}`: {why}."
             for a in analyses for n, r in summary["variants"].items() if (why := (r.get("not_made") or {}).get(a))]
    return lines + [""] if lines else []


def header(summary: dict, env: dict, runs: dict) -> list[str]:
    """The title, the verdict paragraph and the model it is about."""
    lines = ["# ampbench report: what FP16 mixed precision bought here", "", paragraph(summary, env), ""]
    return lines + ([f"{model_line(_first(runs))}.", ""] if runs else [])


def results(summary: dict, env: dict, runs: dict) -> list[str]:
    """The results table, what is missing, how to read it, the interval's method, and time to accuracy."""
    base = summary["baseline"]
    lines = ["## Results (measured in this run)", "",
             "| variant | precision | accumulation | img/s (p10 to p90 step) | speedup vs fp32 (95% CI) | vs tf32 "
             "| peak memory | memory vs fp32 | activations | activations vs fp32 | TFLOP/s | time per epoch "
             "| final accuracy | accuracy vs fp32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary["variants"].items():
        vs_tf32 = fmt.times(r["vs_tf32"]) if r.get("vs_tf32") is not None else "n/a"
        lines.append(
            f"| {name} | {r['precision']} | {r['accum_steps']} | {_imgs_per_s(r)} | {_speedup(r)} | {vs_tf32} "
            f"| {fmt.size(r['peak_mem_bytes'])} | {fmt.change(r.get('mem_ratio'))} | {fmt.size(r['activation_bytes'])} "
            f"| {fmt.change(r.get('activation_ratio'))} | {_tflops(r)} | {fmt.num(r['epoch_time_s'], '.1f')} s "
            f"| {_accuracy(r)} | {fmt.points(r.get('acc_diff'))} |")
    lines.append("")
    if summary.get("missing"):
        lines += [f"No finished run for: {', '.join(summary['missing'])} (missing, not estimated).", ""]
    lines += [
        "How to read it: img/s is training throughput after the warm-up steps: the timed images over the summed "
        "step times, each step timed end to end (from one step's data to the next's: data, compute and the host's "
        "work between steps; evaluation excluded; CUDA events on a GPU); in brackets the p10 and p90 of the "
        "steps' own rates. The speedup is the ratio of two img/s figures. TFLOP/s is "
        "model FLOPs (forward + backward, torch.utils.flop_counter) times img/s; on a known GPU, against the "
        "datasheet's dense peak for that precision (a datasheet figure, not measured). Peak memory is "
        + ("CUDA peak allocated over the steady-state training steps (evaluation apart)" if env.get("gpu")
           else "the process's peak RSS (on a CPU it mostly counts the process and data, not the model)")
        + "; activations are the bytes autograd saves for backward in one forward pass of one micro-batch. "
        + (f"Ratios are against `{base}` (strict IEEE fp32)" if base else "No fp32 variant ran, so there are no ratios")
        + (f"; vs tf32 against `{summary['tf32_baseline']}` (TF32 matmuls and convolutions: PyTorch's default "
           "for convolutions)." if summary.get("tf32_baseline") else "."), ""]
    methods = sorted({r["speedup_ci_method"] for r in summary["variants"].values() if r.get("speedup_ci_method")})
    if methods:
        caveat = (" A bootstrap over the step times of one process says nothing about process-to-process "
                  "variation (another process can land on other kernels, clocks or memory placement); set "
                  "train.repeats: 3 or more for a figure to publish.")
        lines += [f"Speedup interval: {'; '.join(methods)}."
                  + (caveat if any(m.startswith("bootstrap") for m in methods) else ""), ""]
    return lines + not_made(summary, "flops") + _time_to_accuracy(summary)


def _time_to_accuracy(summary: dict) -> list[str]:
    target = summary.get("target_acc")
    if not target:
        return []
    base = summary["variants"].get(summary["baseline"] or "", {}).get("time_to_target_s")
    lines = [f"Training time to {target:.1%} evaluation accuracy (epoch times summed, evaluation excluded):", "",
             "| variant | time to target | reached at epoch | speedup vs fp32 (time ratio) |", "|---|---|---|---|"]
    for name, r in summary["variants"].items():
        t = r.get("time_to_target_s")
        if t is None:
            lines.append(f"| {name} | not reached | - | - |")
        else:
            lines.append(f"| {name} | {t:.1f} s | {r['time_to_target_epoch']} | "
                         f"{fmt.times(base / t) if base else 'n/a'} |")
    return lines + [""]


def profile(summary: dict, env: dict, runs: dict) -> list[str]:
    """A category table per variant, why each variant against the baseline, GPU idle time, the profile's cost."""
    lines = ["## Why: the step profile", ""]
    rows = {n: r["profile"] for n, r in summary["variants"].items() if (r.get("profile") or {}).get("categories")}
    failed = not_made(summary, "profile")
    if not rows:
        return lines + (failed or ["No step profile (profile.steps: 0)."])
    lines += failed
    names = list(rows)
    first = rows[names[0]]
    lines += [f"Time per optimizer step by op category, from torch.profiler over {first['steps']} steps per variant "
              f"after training, with the trained model's state (never inside a timed step); time is {first['basis']}"
              ", each op's own time (self time), with the dtypes it ran in.", "",
              "| category | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for cat in profile_categories(list(rows.values())):
        cells = []
        for n in names:
            c = rows[n]["categories"].get(cat)
            cells.append(f"{c['ms_per_step']:.3g} ms ({c['share']:.0%}; {c['dtypes'] or 'no float inputs'})"
                         if c else "-")
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    lines.append("| step wall time | " + " | ".join(f"{rows[n]['wall_ms_per_step']:.3g} ms" for n in names) + " |")
    on_gpu = "gpu_busy_fraction" in first
    if on_gpu:
        lines.append("| GPU busy (kernels / wall) | " + " | ".join(fmt.pct(rows[n]["gpu_busy_fraction"])
                                                                    for n in names) + " |")
        lines.append("| kernels per step | " + " | ".join(f"{rows[n]['kernels_per_step']:.0f}" for n in names) + " |")
    lines.append("")
    for name, cmp in (summary.get("profile_comparison") or {}).items():
        if name == summary.get("headline"):
            lines += [f"{name} against {summary['baseline']}: the verdict above says where its time went.", ""]
        else:
            lines += [why(name, summary["baseline"], cmp), ""]
    if on_gpu:
        idle = [f"{n} {fmt.pct(1 - rows[n]['gpu_busy_fraction'])}" for n in names]
        lines += ["Share of the step the GPU sat idle waiting for the host (launch-bound when large): "
                  + ", ".join(idle) + ".", ""]
    cost = sum(rows[n].get("cost_s") or 0 for n in names)
    lines += [f"Profiling cost {cost:.1f} s in all, outside the timed steps (the profiled steps run with the "
              "profiler's overhead, so their wall time is above the timed steps'). Each run's trace is "
              "`profile_trace.json` in its run folder and MLflow run: open it in https://ui.perfetto.dev or "
              "chrome://tracing.", ""]
    return lines


def article(summary: dict, env: dict, runs: dict) -> list[str]:
    """Our ratios beside the article's 3.2x and -51%, and the article's own table."""
    lines = ["## Ours beside the article's", "",
             "| | speedup vs FP32 | peak memory vs FP32 |", "|---|---|---|",
             f"| the article (its GPU, quoted) | {ARTICLE['speedup']} | {ARTICLE['memory_change']} |"]
    for name, r in summary["variants"].items():
        if name != summary["baseline"]:
            lines.append(f"| {name}, this run | {_speedup(r)} | {fmt.change(r.get('mem_ratio'))} |")
    lines += [""] + _article_roofline(summary.get("roofline"))
    lines += [f"The article's own table ({ARTICLE['hardware']}; quoted, not measured here):", "",
              "| precision | memory | img/s | time per epoch |", "|---|---|---|---|"]
    lines += [f"| {r['precision']} | {r['memory']} | {r['imgs_per_s']} | {r['epoch']} |" for r in ARTICLE["rows"]]
    return lines + ["", f"The article's claim: {ARTICLE['speedup']} faster, {ARTICLE['memory_change']} memory.", ""]


def _article_roofline(found: dict | None) -> list[str]:
    a = (found or {}).get("article")
    if not a:
        return []
    r, claimed = a["fp16_vs_fp32"], float(ARTICLE["speedup"].rstrip("x"))
    return [f"On the article's {a['gpu']}, the roofline of ResNet-18 at batch {a['batch']} (counted here, op by op, at "
            f"that card's datasheet peaks) gives fp16 {fmt.times(r)} strict fp32: a GeForce card runs fp16 with fp32 "
            "accumulation at twice its fp32 rate, and fp16 halves the bytes each op moves. The article's "
            f"{ARTICLE['speedup']} is {claimed / r:.2f}x that bound, so its FP32 run reached {r / claimed:.0%} of the "
            "share of its peak its FP16 run reached: its baseline was slow (eager overhead, the input pipeline, or a "
            "setting that held fp32 back), which a precision cannot be credited with.", ""]


def _census_lines(found: dict) -> list[str]:
    """What each converting rung converts in this model (roofline.json keeps each census under its rung)."""
    return [line for name in precision.converting(n for n in found if n in precision.RUNGS)
            for line in precision.rung(name).census_lines(found[name])]


def roofline(summary: dict, env: dict, runs: dict) -> list[str]:
    """What the datasheet allows each precision for this model, beside what was measured."""
    found = summary.get("roofline")
    if not found:
        return []
    lines = ["## What the datasheet allows: the roofline", ""]
    if found.get("error"):
        return lines + [f"Not counted: {found['error']}.", ""]
    lines.append(
        f"One training step of {found['model']} at batch {found['batch']} is {found['flops'] / 1e9:,.1f} GFLOP and "
        f"moves {found['bytes'] / 1e9:,.2f} GB in fp32 (counted op by op on meta tensors). "
        f"{found['conv_flop_share']:.0%} of its FLOPs are convolutions, so plain PyTorch (TF32 convolutions, IEEE "
        f"matmuls) trains it closest to {'tf32' if found['closest_default'] == 'tf32' else 'strict fp32'}: that "
        "column is what a user of plain PyTorch starts from.")
    lines += _census_lines(found)
    gpu = found.get("gpu")
    if not gpu:
        where = f"{env['gpu']['name']} is not in the datasheet table" if env.get("gpu") else "this ran on a CPU"
        return lines + ["", f"There is no bound to set beside the measurements: {where}. `ampbench roofline --gpu "
                        "all` gives each precision's bound on every GPU of the table.", ""]
    by_precision: dict[str, list[str]] = {}
    for name, m in found["measured"].items():
        by_precision.setdefault(m["precision"], []).append(
            f"{name}: {fmt.times(m['speedup'])} measured, {m['of_roofline']:.0%} of the bound's img/s")
    lines += ["", f"On {gpu['name']} ({gpu['source']}; {gpu['bandwidth_gbps']:,} GB/s):", ""]
    return lines + roofline_table(gpu["table"], by_precision) + ["", ROOFLINE_NOTE, ""]


ROOFLINE_NOTE = (
    "What a roofline is: one training step counted op by op (FLOPs and the bytes each op reads and writes; eager "
    "kernels, no fusion, fp8's scaling as torch.compile fuses it), each op at max(FLOPs / the datasheet peak of the "
    "dtype it runs in, bytes / memory bandwidth). Its ratio is what switching precision would buy if both precisions "
    "ran every kernel at the datasheet's peaks. Real kernels run below peak, and unevenly: a measured speedup above "
    "the roofline ratio means the slower precision ran further below its peak.")


def roofline_table(table: dict[str, dict | None], measured: dict[str, list[str]] | None = None) -> list[str]:
    """One GPU's roofline per precision (``roofline.table``), with what was measured beside it when given."""
    extra = " measured |" if measured is not None else ""
    lines = ["| precision | roofline step | roofline img/s | vs strict fp32 | vs tf32 | memory-bound share |" + extra,
             "|---|---|---|---|---|---|" + ("---|" if extra else "")]
    for rung, r in table.items():
        if r is None:
            lines.append(f"| {rung} | no {rung} tensor cores | | | | |" + (" |" if extra else ""))
            continue
        cell = f" {'; '.join(measured.get(rung, [])) or 'not run'} |" if measured is not None else ""
        lines.append(f"| {rung} | {fmt.ms(r['step_ms'])} | {r['imgs_per_s']:,.0f} | {fmt.times(r['vs_fp32'])} "
                     f"| {fmt.times(r['vs_tf32'])} | {r['memory_bound_share']:.0%} |" + cell)
    return lines


def memory(summary: dict, env: dict, runs: dict) -> list[str]:
    """Every memory meter of every variant, and what each one counts."""
    lines = ["## Memory, meter by meter", "",
             "| variant | meter | peak (training) | peak reserved | first step (autotuning) | evaluation peak "
             "| activations (one micro-batch) | parameters | gradients | optimizer state | data set on the device |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary["variants"].items():
        reserved = "n/a on CPU" if r.get("mem_meter") == "process_peak_rss" else fmt.size(r.get("peak_reserved_bytes"))
        cuda_only = "n/a on CPU" if r.get("mem_meter") == "process_peak_rss" else None
        lines.append(f"| {name} | {r.get('mem_meter') or 'missing'} | {fmt.size(r['peak_mem_bytes'])} | {reserved} "
                     f"| {cuda_only or fmt.size(r.get('first_step_peak_mem_bytes'))} "
                     f"| {cuda_only or fmt.size(r.get('eval_peak_mem_bytes'))} "
                     f"| {fmt.size(r['activation_bytes'])} | {fmt.size(r.get('param_bytes'))} "
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
        "across devices. Parameters, gradients and the optimizer's state (SGD's momentum: one value per parameter; "
        "AdamW's two moments: two) stay fp32 in every variant. The data "
        "set lives on the device (uint8, padded for cropping) and is part of every variant's peak.", "",
        *not_made(summary, "activations"), *_optimizer_state_outweighs(summary)]


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


def gpu_state(summary: dict, env: dict, runs: dict) -> list[str]:
    """SM clock, temperature, power and energy per image per variant (NVML samples); nothing without them."""
    rows = {n: r for n, r in summary["variants"].items() if r.get("gpu_sm_clock_mhz_median") is not None
            or r.get("gpu_power_w_median") is not None}
    if not rows:
        return []
    lines = ["## GPU clock, temperature and energy", "",
             "| variant | ran | median SM clock | vs the baseline's | median temperature | median power | energy per "
             "image | energy vs the baseline |", "|---|---|---|---|---|---|---|---|"]
    order = summary.get("run_order") or []
    for name, r in rows.items():
        ran = f"{order.index(name) + 1} of {len(order)}" if name in order else "-"
        clock = fmt.num(r.get("gpu_sm_clock_mhz_median"), ",.0f", "n/a")
        lines.append(f"| {name} | {ran} | {clock} MHz | {fmt.change(r.get('sm_clock_ratio'))} "
                     f"| {fmt.num(r.get('gpu_temperature_c_median'), '.0f', 'n/a')} C "
                     f"| {fmt.num(r.get('gpu_power_w_median'), ',.0f', 'n/a')} W "
                     f"| {fmt.num(r.get('energy_per_image_j'), '.3g', 'n/a')} J "
                     f"| {fmt.times(r.get('energy_ratio'))} |")
    lines += ["", "Sampled by NVML every 0.5 s during each variant's train stage (setup, evaluation and the profile "
              "included), on the GPU it trained on (found by UUID; rank 0's under DDP). Energy per image is that "
              "GPU's median power over its own img/s. The variants ran one after another, "
              "in the order shown; a GPU that heats up can lower its clock for the later ones.", ""]
    differs = [n for n, r in rows.items() if r.get("clock_differs")]
    if differs:
        lines += ["The median SM clock of " + ", ".join(f"`{n}`" for n in differs) + " differs by more than 5% from "
                  "the baseline's: part of their speed difference is the clock's, not the precision's (the GPU may "
                  "have throttled, or boosted); rerun with the variants in another order to tell.", ""]
    return lines


def safety(summary: dict, env: dict, runs: dict) -> list[str]:
    """Skipped steps, non-finite losses, the accumulation check and the fp16 audit's layers at risk."""
    lines = ["## Numerical safety", "",
             "| variant | status | skipped (overflow) steps | inf/NaN-loss steps | final loss scale "
             "| accumulation vs full batch (max rel. diff, fp32) |", "|---|---|---|---|---|---|"]
    for name, r in summary["variants"].items():
        scale = "n/a (no scaler)" if r.get("final_loss_scale") is None else f"{r['final_loss_scale']:g}"
        lines.append(f"| {name} | {r.get('status', 'complete')} | {fmt.num(r.get('skipped_steps'), 'd')} "
                     f"| {fmt.num(r.get('nonfinite_loss_steps'), 'd')} | {scale} "
                     f"| {fmt.num(r.get('accum_grad_max_rel_diff'), '.1e', 'n/a')} |")
    lines.append("")
    accum = [(n, r) for n, r in summary["variants"].items() if r["accum_steps"] > 1]
    if accum:
        lines += ["The accumulation check runs BatchNorm in eval mode. In training, BatchNorm normalises each "
                  "micro-batch with that micro-batch's own statistics ("
                  + ", ".join(f"`{n}`: {r['accum_steps']} micro-batches per step" for n, r in accum)
                  + "), so accumulated steps are not identical to full-batch steps; a difference in loss or "
                  "accuracy against the unaccumulated variant can come from this, not from fp16.", ""]
    for name in precision.names():  # what a rung says of its own numerics (fp8: its scaling, not a loss scale)
        runs_of = [(n, r) for n, r in summary["variants"].items() if r["precision"] == name]
        note = precision.rung(name).runs_note(runs_of) if runs_of else None
        lines += [note, ""] if note else []
    lines += not_made(summary, "accumulation", "audit")
    lines += _grad_norms(summary["baseline"], runs)
    for name, run in runs.items():
        if run.get("numerics"):
            lines += _audit(name, run)
    return lines


GRAD_NORM_RISE = 2.0  # a variant's late gradient norm this many times the baseline's is flagged


def grad_norm_stats(run: dict) -> dict | None:
    """A run's gradient norms before clipping (grad_norm.csv): median, largest and its step, the median of the
    last tenth of the steps, the share clipped; None without finite norms (skipped fp16 steps' are inf)."""
    rows = [(int(r["step"]), float(r["grad_norm"])) for r in run.get("grad_norm") or []]
    finite = [(s, v) for s, v in rows if math.isfinite(v)]
    if not finite:
        return None
    values = [v for _, v in finite]
    step, largest = max(finite, key=lambda sv: sv[1])
    clip = run["metrics"].get("clip_grad_norm")
    return {"steps": len(rows), "median": statistics.median(values), "largest": largest, "largest_step": step,
            "late": statistics.median(values[-max(1, len(values) // 10):]), "clip": clip,
            "clipped": sum(v > clip for v in values) / len(values) if clip else None}


def _grad_norms(baseline: str, runs: dict) -> list[str]:
    stats = {n: s for n, r in runs.items() if (s := grad_norm_stats(r))}
    if not stats:
        return []
    lines = ["Gradient norm before clipping, per optimizer step (figure `grad_norm.png`):", "",
             "| variant | steps | median | largest (step) | median of the last tenth | clipped |",
             "|---|---|---|---|---|---|"]
    for n, s in stats.items():
        clipped = f"{fmt.pct(s['clipped'])} of steps above {s['clip']:g}" if s["clip"] else "off"
        lines.append(f"| {n} | {s['steps']} | {s['median']:.3g} | {s['largest']:.3g} ({s['largest_step']}) "
                     f"| {s['late']:.3g} | {clipped} |")
    base = stats.get(baseline)
    risen = [n for n, s in stats.items() if base and n != baseline and s["late"] > GRAD_NORM_RISE * base["late"]]
    lines += ["", "A gradient norm that rises in a low-precision run and not in the baseline is an early sign of "
              "trouble: overflowing activations, a loss scale too high, a learning rate the precision cannot hold."
              + (f" Risen against {baseline} (last tenth, more than {GRAD_NORM_RISE:g}x): "
                 + ", ".join(f"{n} ({stats[n]['late'] / base['late']:.1f}x)" for n in risen) + "." if risen else ""),
              ""]
    return lines


def _audit(name: str, run: dict) -> list[str]:
    """The fp16 numerics audit of one run: its five layers most at risk."""
    rows, scale = run["numerics"], run["metrics"].get("final_loss_scale")
    at_risk = sorted(rows, key=lambda r: -float(r["grad_underflow"]))[:5]
    at_risk = [r for r in at_risk if float(r["grad_underflow"]) > 0 or float(r["act_overflow"]) > 0]
    lines = [f"fp16 numerics audit of `{name}` ({len(rows)} layers; gradients measured in fp32, then "
             f"cast to fp16 unscaled and at the loss scale in use, {scale:g}):", ""]
    if not at_risk:
        lines.append("- no layer had gradient values that fp16 would flush to zero, or activations that "
                     "would overflow.")
    for r in at_risk:
        lines.append(f"- `{r['layer']}` ({r['type']}, runs in {r['autocast_dtype']}): "
                     f"{float(r['grad_underflow']):.2%} of its gradient values flush to zero in fp16 unscaled, "
                     f"{float(r['grad_scaled_underflow']):.2%} at scale {scale:g}; "
                     f"{float(r['grad_subnormal']):.2%} subnormal unscaled; "
                     f"{float(r['act_overflow']):.2%} of activations overflow.")
    return lines + [""]


def figures(summary: dict, env: dict, runs: dict) -> list[str]:
    """Every figure drawn, by its path relative to report.md."""
    found, failed = summary.get("figures") or [], summary.get("figures_not_drawn") or {}
    lines = [f"Figure {name} could not be drawn: {why}." for name, why in failed.items()]
    lines = lines + [""] if lines else []
    return ["## Figures", ""] + lines + [f"![{Path(f).stem}]({f})" for f in found] + [""] if found or lines else []


def environment(summary: dict, env: dict, runs: dict) -> list[str]:
    """Hardware, software, the baseline's TF32 setting, the model, the processes, the commit, the params."""
    gpu = env.get("gpu")
    if gpu:
        yes = {True: "yes", False: "no"}
        hw = (f"{gpu['name']} (compute capability {gpu['capability']}, driver {gpu.get('driver') or 'unknown'}, "
              f"tensor cores: {yes[gpu['tensor_cores']]}, bf16: {yes[gpu['bf16_supported']]})")
    else:
        hw = f"no GPU: CPU {env.get('cpu_model')}, {env.get('cpu_count')} cores (fp16 is emulated on a CPU)"
    first = _first(runs)
    defaults = env.get("tf32_defaults")
    lines = ["## Environment", "", f"- Hardware: {hw}",
             f"- Software: torch {env.get('torch')}, CUDA runtime {env.get('cuda_runtime')}, "
             f"cuDNN {env.get('cudnn')}, Python {env.get('python')}",
             f"- {_tf32_line(runs)}"
             + (f"; torch's defaults here: matmul {defaults['matmul_fp32_precision']}, cuDNN convolutions "
                f"{defaults['cudnn_conv_fp32_precision']}" if defaults else ""),
             f"- {model_line(first)}, batch {first.get('batch_size')}, {first.get('epochs')} epochs, "
             f"device {first.get('device')}", _processes(runs),
             f"- Code: git commit {first.get('git_commit', 'unknown')}"]
    changed = summary.get("params_changed") or {}
    if changed:
        lines.append("- Params that differ from the defaults: "
                     + ", ".join(f"`{k}: {v}`" for k, v in sorted(changed.items())))
    else:
        lines.append("- Params: the defaults")
    return lines + [""]


def _tf32_line(runs: dict[str, dict]) -> str:
    """What each variant's fp32 matmuls and convolutions ran in (in autocast variants: the ops it leaves fp32)."""
    groups: dict[str, list[str]] = {}
    for name, r in runs.items():
        flags = r["metrics"].get("tf32") or {}
        key = (f"matmul {flags.get('matmul_fp32_precision', '?')}, convolutions "
               f"{flags.get('cudnn_conv_fp32_precision', '?')}")
        groups.setdefault(key, []).append(name)
    return ("fp32 math (in fp16 and bf16 variants: the ops autocast leaves in fp32): "
            + "; ".join(f"{', '.join(names)}: {key}" for key, names in groups.items()))


def _processes(runs: dict[str, dict]) -> str:
    worlds = {n: r["metrics"].get("world_size") or 1 for n, r in runs.items()}
    ddp = [n for n, w in worlds.items() if w > 1]
    if not ddp:
        return "- Processes: one per variant (world size 1)"
    m = runs[ddp[0]]["metrics"]
    return (f"- Processes: {m['world_size']} (torchrun, {m.get('backend')} backend) for {', '.join(ddp)}; one for "
            f"{', '.join(n for n in worlds if n not in ddp) or 'none'}; the global batch of {m.get('batch_size')} "
            "is split over the processes")


def reproduce(summary: dict, env: dict, runs: dict) -> list[str]:
    return ["## Reproduce", "", "```", "git checkout <the commit above>", "dvc repro          # or: make repro",
            "```", ""]


# The report, in order: a new section is a function above and its name here.
SECTIONS = (header, results, roofline, profile, article, memory, sweep, scaling, gpu_state, safety, figures,
            environment, reproduce)


def render(summary: dict, env: dict, runs: dict[str, dict]) -> str:
    """report.md's text."""
    return "\n".join(line for section in SECTIONS for line in section(summary, env, runs))
