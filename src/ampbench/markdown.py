"""report.md's text: the verdict, the tables, the safety section, the environment, written from the summary.

Every number here comes from the run files through ``report.summarize``; the
only numbers that do not are the article's, quoted and labelled as such.
"""

from __future__ import annotations

from pathlib import Path

from ampbench import explain, scaling, sweepreport

# The article's own measurement (ResNet-18, CIFAR-10, batch 256, CUDA 12.1, "NVIDIA 5090 (24GB)"): quoted, not ours.
ARTICLE = {
    "hardware": 'the article\'s "NVIDIA 5090 (24GB)", CUDA 12.1, ResNet-18, CIFAR-10, batch 256',
    "rows": [
        {"precision": "FP32", "memory": "18.7 GB", "imgs_per_s": "1,200", "epoch": "3m21s"},
        {"precision": "FP16", "memory": "9.2 GB", "imgs_per_s": "3,800", "epoch": "1m02s"},
    ],
    "speedup": "3.2x", "memory_change": "-51%",
}




def _f(value, fmt: str, missing: str = "missing") -> str:
    return missing if value is None else format(value, fmt)


def _bytes(n) -> str:
    if n is None:
        return "missing"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _x(ratio: float) -> str:
    """A ratio with enough digits to tell small ones apart: 3.21, 0.95, 0.0213."""
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.3g}"


def _speedup(row: dict) -> str:
    if row.get("speedup") is None:
        return "n/a"
    lo, hi = row.get("speedup_ci95") or [None, None]
    ci = f" ({_x(lo)} to {_x(hi)})" if lo is not None and hi is not None else ""
    return f"{_x(row['speedup'])}x{ci}"


def _pct_change(ratio) -> str:
    return "n/a" if ratio is None else f"{(ratio - 1) * 100:+.0f}%"


def _ips(r: dict) -> str:
    spread = r.get("imgs_per_s_p10_p90")
    extra = f" ({spread[0]:,.0f} to {spread[1]:,.0f})" if spread else ""
    if r.get("imgs_per_s_std") is not None:
        extra += f" ±{r['imgs_per_s_std']:,.0f} sd over {r['repeats']} repeats"
    return _f(r["imgs_per_s"], ",.0f") + extra


def _tflops(r: dict) -> str:
    if r.get("achieved_tflops") is None:
        return "missing"
    frac = r.get("fraction_of_peak")
    of_peak = f" ({frac:.0%} of {r['peak_tflops_datasheet']:g} {r['peak_precision']} peak)" if frac else ""
    return f"{r['achieved_tflops']:.3g}{of_peak}"


def _acc(r: dict) -> str:
    sd = f" ±{r['final_acc_std'] * 100:.2f}" if r.get("final_acc_std") is not None else ""
    return _f(r["final_acc"], ".2%") + sd


def results_table(summary: dict) -> list[str]:
    lines = ["| variant | precision | accumulation | img/s (p10 to p90 step) | speedup vs fp32 (95% CI) "
             "| peak memory | memory vs fp32 | activations | activations vs fp32 | TFLOP/s | time per epoch "
             "| final accuracy | accuracy vs fp32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary["variants"].items():
        diff = r.get("acc_diff")
        lines.append(
            f"| {name} | {r['precision']} | {r['accum_steps']} | {_ips(r)} | {_speedup(r)} "
            f"| {_bytes(r['peak_mem_bytes'])} | {_pct_change(r.get('mem_ratio'))} | {_bytes(r['activation_bytes'])} "
            f"| {_pct_change(r.get('activation_ratio'))} | {_tflops(r)} | {_f(r['epoch_time_s'], '.1f')} s "
            f"| {_acc(r)} | {'n/a' if diff is None else f'{diff * 100:+.2f} pts'} |")
    return lines


def memory_table(summary: dict) -> list[str]:
    lines = ["| variant | meter | peak | peak reserved | activations (one micro-batch) | parameters | gradients "
             "| optimizer state | data set on the device |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary["variants"].items():
        reserved = "n/a on CPU" if r.get("mem_meter") == "process_peak_rss" else _bytes(r.get("peak_reserved_bytes"))
        lines.append(f"| {name} | {r.get('mem_meter') or 'missing'} | {_bytes(r['peak_mem_bytes'])} | {reserved} "
                     f"| {_bytes(r['activation_bytes'])} | {_bytes(r.get('param_bytes'))} "
                     f"| {_bytes(r.get('grad_bytes'))} | {_bytes(r.get('optimizer_state_bytes'))} "
                     f"| {_bytes(r.get('dataset_bytes'))} |")
    return lines


def article_table() -> list[str]:
    lines = [f"The article's own table ({ARTICLE['hardware']}; quoted, not measured here):", "",
             "| precision | memory | img/s | time per epoch |", "|---|---|---|---|"]
    for r in ARTICLE["rows"]:
        lines.append(f"| {r['precision']} | {r['memory']} | {r['imgs_per_s']} | {r['epoch']} |")
    lines += ["", f"The article's claim: {ARTICLE['speedup']} faster, {ARTICLE['memory_change']} memory."]
    return lines


def _main_fp16(summary: dict) -> str | None:
    """The variant the verdict speaks of: fp16 without accumulation, else any non-baseline variant."""
    rows = summary["variants"]
    for name, r in rows.items():
        if r["precision"] == "fp16" and r["accum_steps"] == 1 and r.get("speedup") is not None:
            return name
    return next((n for n, r in rows.items() if n != summary["baseline"] and r.get("speedup") is not None), None)


def _reasons(r: dict, base: dict, env: dict) -> list[str]:
    """Why mixed precision may not pay off here, from what the environment and the run show."""
    gpu = env.get("gpu")
    out = []
    if not gpu:
        out.append("this ran on a CPU, which has no fp16 tensor cores: fp16 arithmetic is emulated there")
    elif not gpu.get("tensor_cores"):
        out.append(f"{gpu['name']} has no tensor cores")
    if gpu and (base.get("peak_precision") == "tf32"):
        out.append("the FP32 baseline ran with TF32 tensor cores (allow_tf32: true), so it was already fast")
    if (r.get("data_time_fraction") or 0) > 0.3:
        out.append(f"data loading took {r['data_time_fraction']:.0%} of each step")
    if gpu and (r.get("step_time_ms_median") or 1e9) < 5:
        out.append(f"steps are short ({r['step_time_ms_median']:.1f} ms), so kernel launch overhead weighs heavily")
    return out


def verdict(summary: dict, env: dict) -> str:
    """A first paragraph in plain language, written from the measured numbers."""
    name = _main_fp16(summary)
    base_name = summary["baseline"]
    if name is None or base_name is None:
        return ("There is no FP32 baseline and FP16 variant pair among the finished runs, so there is no verdict; "
                "the table below shows what was measured.")
    rows = summary["variants"]
    r, base = rows[name], rows[base_name]
    where = env["gpu"]["name"] if env.get("gpu") else f"this CPU ({env.get('cpu_model')})"
    sp, (lo, hi) = r["speedup"], r.get("speedup_ci95") or [None, None]
    one_process = (r.get("speedup_ci_method") or "").startswith("bootstrap")
    ci = (f" (95% CI {_x(lo)} to {_x(hi)}{', from one process' + chr(39) + 's step times' if one_process else ''})"
          if lo is not None and hi is not None else "")
    if lo is not None and lo > 1.02:
        speed = f"trained {_x(sp)}x faster{ci} than strict FP32"
    elif hi is not None and hi < 0.98:
        speed = f"was slower than FP32: {_x(sp)}x its throughput{ci}"
    else:
        speed = f"was no faster than FP32 ({_x(sp)}x{ci})"
    mem = r.get("mem_ratio")
    if mem is None:
        mem_text = "with peak memory not measured"
    elif abs(mem - 1) < 0.005:
        mem_text = "with the same peak memory (within 0.5%)"
    else:
        mem_text = f"using {abs(mem - 1):.0%} {'less' if mem < 1 else 'more'} peak memory"
    act = r.get("activation_ratio")
    act_text = f" and {abs(act - 1):.0%} {'less' if act < 1 else 'more'} activation memory" if act is not None else ""
    acc, b_acc, diff = r.get("final_acc"), base.get("final_acc"), r.get("acc_diff")
    acc_text = ""
    if acc is not None and b_acc is not None:
        spread = max(r.get("final_acc_std") or 0, base.get("final_acc_std") or 0)
        judged = (f"within run-to-run spread (sd {spread * 100:.2f} points)" if spread and abs(diff) <= 2 * spread
                  else f"a difference of {diff * 100:+.2f} points"
                  + ("" if spread else " from a single run each, so its spread is unknown"))
        acc_text = f"; final accuracy {acc:.2%} against {b_acc:.2%}, {judged}"
    text = f"On {where}, {name} (FP16-AMP) {speed}, {mem_text}{act_text}{acc_text}."
    if not (lo is not None and lo > 1.02):
        why = _reasons(r, base, env)
        if why:
            text += " Why: " + "; ".join(why) + "."
    if r.get("skipped_steps"):
        text += f" The loss scaler skipped {r['skipped_steps']} overflowing steps."
    cmp = (summary.get("profile_comparison") or {}).get(name)
    if cmp:
        text += " " + explain.why(name, base_name, cmp)
    return text


def comparison_table(summary: dict) -> list[str]:
    """Our ratios beside the article's 3.2x and -51%."""
    lines = ["| | speedup vs FP32 | peak memory vs FP32 |", "|---|---|---|",
             f"| the article (its GPU, quoted) | {ARTICLE['speedup']} | {ARTICLE['memory_change']} |"]
    for name, r in summary["variants"].items():
        if name != summary["baseline"]:
            lines.append(f"| {name}, this run | {_speedup(r)} | {_pct_change(r.get('mem_ratio'))} |")
    return lines


def safety_lines(summary: dict, runs: dict[str, dict]) -> list[str]:
    """Skipped steps, non-finite losses, the accumulation check and the fp16 audit's layers at risk."""
    lines = ["| variant | status | skipped (overflow) steps | inf/NaN-loss steps | final loss scale "
             "| accumulation vs full batch (max rel. diff, fp32) |", "|---|---|---|---|---|---|"]
    for name, r in summary["variants"].items():
        scale = "n/a (no scaler)" if r.get("final_loss_scale") is None else f"{r['final_loss_scale']:g}"
        acc = "n/a" if r.get("accum_grad_max_rel_diff") is None else f"{r['accum_grad_max_rel_diff']:.1e}"
        lines.append(f"| {name} | {r.get('status', 'complete')} | {_f(r.get('skipped_steps'), 'd')} "
                     f"| {_f(r.get('nonfinite_loss_steps'), 'd')} | {scale} | {acc} |")
    lines.append("")
    accum = [(n, r) for n, r in summary["variants"].items() if r["accum_steps"] > 1]
    if accum:
        lines += ["The accumulation check runs BatchNorm in eval mode. In training, BatchNorm normalises each "
                  "micro-batch with that micro-batch's own statistics ("
                  + ", ".join(f"`{n}`: {r['accum_steps']} micro-batches per step" for n, r in accum)
                  + "), so accumulated steps are not identical to full-batch steps; a difference in loss or "
                  "accuracy against the unaccumulated variant can come from this, not from fp16.", ""]
    for name, run in runs.items():
        rows = run.get("numerics") or []
        if not rows:
            continue
        scale = run["metrics"].get("final_loss_scale")
        at_risk = sorted(rows, key=lambda r: -float(r["grad_underflow"]))[:5]
        at_risk = [r for r in at_risk if float(r["grad_underflow"]) > 0 or float(r["act_overflow"]) > 0]
        lines.append(f"fp16 numerics audit of `{name}` ({len(rows)} layers; gradients measured in fp32, then "
                     f"cast to fp16 unscaled and at the loss scale in use, {scale:g}):")
        lines.append("")
        if not at_risk:
            lines.append("- no layer had gradient values that fp16 would flush to zero, or activations that "
                         "would overflow.")
        for r in at_risk:
            lines.append(f"- `{r['layer']}` ({r['type']}, runs in {r['autocast_dtype']}): "
                         f"{float(r['grad_underflow']):.2%} of its gradient values flush to zero in fp16 unscaled, "
                         f"{float(r['grad_scaled_underflow']):.2%} at scale {scale:g}; "
                         f"{float(r['grad_subnormal']):.2%} subnormal unscaled; "
                         f"{float(r['act_overflow']):.2%} of activations overflow.")
        lines.append("")
    return lines


def _env_lines(env: dict, runs: dict[str, dict], changed: dict) -> list[str]:
    gpu = env.get("gpu")
    if gpu:
        yes = {True: "yes", False: "no"}
        hw = (f"{gpu['name']} (compute capability {gpu['capability']}, driver {gpu.get('driver') or 'unknown'}, "
              f"tensor cores: {yes[gpu['tensor_cores']]}, bf16: {yes[gpu['bf16_supported']]})")
    else:
        hw = f"no GPU: CPU {env.get('cpu_model')}, {env.get('cpu_count')} cores (fp16 is emulated on a CPU)"
    first = next(iter(runs.values()))["metrics"] if runs else {}
    strict = (first.get("tf32") or {}).get("matmul_fp32_precision") == "ieee"
    lines = [f"- Hardware: {hw}",
             f"- Software: torch {env.get('torch')}, CUDA runtime {env.get('cuda_runtime')}, "
             f"cuDNN {env.get('cudnn')}, Python {env.get('python')}",
             f"- FP32 baseline: {'strict IEEE fp32 (TF32 off)' if strict else 'TF32 allowed (allow_tf32: true)'}"
             + (f"; torch's defaults here: matmul {d['matmul_fp32_precision']}, cuDNN convolutions "
                f"{d['cudnn_conv_fp32_precision']}" if (d := env.get("tf32_defaults")) else ""),
             f"- {model_line(first)}, batch {first.get('batch_size')}, {first.get('epochs')} epochs, "
             f"device {first.get('device')}",
             f"- Code: git commit {first.get('git_commit', 'unknown')}"]
    worlds = {n: r["metrics"].get("world_size") or 1 for n, r in runs.items()}
    if any(w > 1 for w in worlds.values()):
        ddp = [n for n, w in worlds.items() if w > 1]
        m = runs[ddp[0]]["metrics"]
        lines.insert(-1, f"- Processes: {m['world_size']} (torchrun, {m.get('backend')} backend) for "
                         f"{', '.join(ddp)}; one for {', '.join(n for n in worlds if n not in ddp) or 'none'}; "
                         f"the global batch of {m.get('batch_size')} is split over the processes")
    else:
        lines.insert(-1, "- Processes: one per variant (world size 1)")
    if changed:
        lines.append("- Params that differ from the defaults: "
                     + ", ".join(f"`{k}: {v}`" for k, v in sorted(changed.items())))
    else:
        lines.append("- Params: the defaults")
    return lines


def model_line(m: dict) -> str:
    """Model <name> (<n> parameters, <s>x<s> inputs), <k> classes of <data> (<n> train / <n> test images)."""
    params = f"{m['param_count']:,} parameters, " if m.get("param_count") else ""
    size = f"{m['input_size']}x{m['input_size']} inputs" if m.get("input_size") else "CIFAR-sized inputs"
    classes = f"{m['num_classes']} classes of " if m.get("num_classes") else ""
    return (f"Model {m.get('model') or m.get('arch')} ({params}{size}), {classes}{m.get('data_source')} data "
            f"({m.get('train_images')} train / {m.get('test_images')} test images)")


def render(summary: dict, env: dict, runs: dict[str, dict], figures: list[str], changed: dict) -> str:
    base = summary["baseline"]
    first = next(iter(runs.values()))["metrics"] if runs else {}
    lines = ["# ampbench report: what FP16 mixed precision bought here", "",
             verdict(summary, env) + sweepreport.sentence(summary.get("sweep"))
             + scaling.sentence(summary.get("scaling")), ""]
    if first:
        lines += [f"{model_line(first)}.", ""]
    lines += ["## Results (measured in this run)", ""] + results_table(summary) + [""]
    if summary.get("missing"):
        lines += [f"No finished run for: {', '.join(summary['missing'])} (missing, not estimated).", ""]
    lines += [
        "How to read it: img/s is training throughput after the warm-up steps, timed end to end (from one step's "
        "data to the next's: data, compute and the host's work between steps; evaluation excluded; CUDA events "
        "on a GPU); in brackets the throughput at the p90 and p10 step times. TFLOP/s is "
        "model FLOPs (forward + backward, torch.utils.flop_counter) times img/s; on a known GPU, against the "
        "datasheet's dense peak for that precision (a datasheet figure, not measured). Peak memory is "
        + ("CUDA peak allocated" if env.get("gpu") else "the process's peak RSS (on a CPU it mostly counts the "
           "process and data, not the model)")
        + "; activations are the bytes autograd saves for backward in one forward pass of one micro-batch. "
        + (f"Ratios are against `{base}`." if base else "No fp32 variant ran, so there are no ratios."), ""]
    methods = sorted({r["speedup_ci_method"] for r in summary["variants"].values() if r.get("speedup_ci_method")})
    if methods:
        lines += [f"Speedup interval: {'; '.join(methods)}."
                  + (" A bootstrap over the step times of one process says nothing about process-to-process "
                     "variation (another process can land on other kernels, clocks or memory placement); set "
                     "train.repeats: 3 or more for a figure to publish." if any(m.startswith("bootstrap")
                                                                                  for m in methods) else ""), ""]
    lines += explain.time_to_accuracy_lines(summary)
    lines += ["## Why: the step profile", ""] + explain.profile_lines(summary)
    lines += ["## Ours beside the article's", ""] + comparison_table(summary) + [""] + article_table() + [""]
    lines += ["## Memory, meter by meter", ""] + memory_table(summary) + [""]
    lines += ["Peak: CUDA `max_memory_allocated` after `reset_peak_memory_stats` at the start of training "
              "(reserved: what the caching allocator held), or on a CPU the process's peak RSS, which counts "
              "the interpreter and the data set too. Activations: bytes saved for backward, counted with "
              "saved-tensor hooks, each storage once; this is where fp16 saves memory, and it is comparable "
              "across devices. Parameters, gradients and the optimizer's momentum stay fp32 in every variant. The data "
              "set lives on the device (uint8, padded for cropping) and is part of every variant's peak.", ""]
    lines += sweepreport.lines(summary.get("sweep"))
    lines += scaling.lines(summary.get("scaling"))
    lines += ["## Numerical safety", ""] + safety_lines(summary, runs)
    if figures:
        lines += ["## Figures", ""] + [f"![{Path(f).stem}]({f})" for f in figures] + [""]
    lines += ["## Environment", ""] + _env_lines(env, runs, changed) + [""]
    lines += ["## Reproduce", "", "```", "git checkout <the commit above>", "dvc repro          # or: make repro",
              "```", ""]
    return "\n".join(lines)
