"""The report: runs on disk -> report.md, summary.json (DVC metrics) and figures.

It reads only ``reports/runs/*/`` and ``reports/env.json``, never MLflow, so it
works offline. Every number comes from those files; a measurement that is
missing is shown as missing.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ampbench import measure
from ampbench.results import atomic_write, read_runs, write_json

# The article's own measurement (ResNet-18, CIFAR-10, batch 256, CUDA 12.1, "NVIDIA 5090 (24GB)"): quoted, not ours.
ARTICLE = {
    "hardware": 'the article\'s "NVIDIA 5090 (24GB)", CUDA 12.1, ResNet-18, CIFAR-10, batch 256',
    "rows": [
        {"precision": "FP32", "memory": "18.7 GB", "imgs_per_s": "1,200", "epoch": "3m21s"},
        {"precision": "FP16", "memory": "9.2 GB", "imgs_per_s": "3,800", "epoch": "1m02s"},
    ],
    "speedup": "3.2x", "memory_change": "-51%",
}


def pick_baseline(runs: dict[str, dict]) -> str | None:
    """The fp32, no-accumulation run the ratios are taken against (``fp32`` if so named)."""
    candidates = [n for n, r in runs.items()
                  if r["metrics"]["precision"] == "fp32" and r["metrics"]["accum_steps"] == 1]
    if "fp32" in candidates:
        return "fp32"
    return candidates[0] if candidates else None


def _ratio(a, b) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def _ips_spread(m: dict) -> list[float] | None:
    """img/s at the p90 and p10 step times: the spread of throughput across steps."""
    st, bs = m.get("step_time_ms") or {}, m.get("batch_size")
    if not (bs and st.get("p10") and st.get("p90")):
        return None
    return [bs / st["p90"] * 1000, bs / st["p10"] * 1000]


def _speedup_with_ci(base: dict, run: dict) -> dict:
    """Speedup over the baseline and its 95% interval: from repeats when both have 2+, else a bootstrap."""
    bm, m = base["metrics"], run["metrics"]
    b_runs, v_runs = bm.get("imgs_per_s_runs") or [], m.get("imgs_per_s_runs") or []
    if len(b_runs) >= 2 and len(v_runs) >= 2:
        ratio, lo, hi = measure.ratio_ci_from_repeats(v_runs, b_runs)
        return {"speedup": ratio, "speedup_ci95": [lo, hi],
                "speedup_ci_method": f"t-interval over repeats ({len(v_runs)} vs {len(b_runs)})"}
    b_ms = (bm.get("step_time_ms") or {}).get("median")
    ratio = _ratio(b_ms, (m.get("step_time_ms") or {}).get("median"))  # same step times as the interval
    lo, hi = measure.bootstrap_ratio_ci(base["step_times_ms"], run["step_times_ms"])
    return {"speedup": ratio, "speedup_ci95": [None if math.isnan(lo) else lo, None if math.isnan(hi) else hi],
            "speedup_ci_method": "bootstrap over step times (median ratio)"}


def summarize(runs: dict[str, dict]) -> dict:
    """Per-variant figures and ratios against the fp32 baseline."""
    base = pick_baseline(runs)
    bm = runs[base]["metrics"] if base else {}
    out = {"baseline": base, "variants": {}}
    for name, run in runs.items():
        m = run["metrics"]
        row = {
            "precision": m["precision"], "accum_steps": m["accum_steps"],
            "imgs_per_s": m.get("imgs_per_s"), "epoch_time_s": m.get("epoch_time_s"),
            "step_time_ms_median": (m.get("step_time_ms") or {}).get("median"),
            "peak_mem_bytes": m.get("peak_mem_bytes"), "activation_bytes": m.get("activation_bytes"),
            "final_acc": m.get("final_acc"), "best_acc": m.get("best_acc"),
            "skipped_steps": m.get("skipped_steps"), "repeats": m.get("repeats", 1),
            "imgs_per_s_std": m.get("imgs_per_s_std"), "final_acc_std": m.get("final_acc_std"),
            "imgs_per_s_p10_p90": _ips_spread(m),
            "peak_reserved_bytes": m.get("peak_reserved_bytes"), "mem_meter": m.get("mem_meter"),
            "param_bytes": m.get("param_bytes"), "grad_bytes": m.get("grad_bytes"),
            "optimizer_state_bytes": m.get("optimizer_state_bytes"),
            "achieved_tflops": m.get("achieved_tflops"), "fraction_of_peak": m.get("fraction_of_peak"),
            "peak_tflops_datasheet": m.get("peak_tflops_datasheet"), "peak_precision": m.get("peak_precision"),
        }
        if base:
            row.update(_speedup_with_ci(runs[base], run))
            row["mem_ratio"] = _ratio(row["peak_mem_bytes"], bm.get("peak_mem_bytes"))
            row["activation_ratio"] = _ratio(row["activation_bytes"], bm.get("activation_bytes"))
            acc, b_acc = row["final_acc"], bm.get("final_acc")
            row["acc_diff"] = None if acc is None or b_acc is None else acc - b_acc
        out["variants"][name] = row
    return out


# --- formatting --------------------------------------------------------------------------

def _f(value, fmt: str, missing: str = "missing") -> str:
    return missing if value is None else format(value, fmt)


def _bytes(n) -> str:
    if n is None:
        return "missing"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _speedup(row: dict) -> str:
    if row.get("speedup") is None:
        return "n/a"
    lo, hi = row.get("speedup_ci95") or [None, None]
    ci = f" ({lo:.2f} to {hi:.2f})" if lo is not None and hi is not None else ""
    return f"{row['speedup']:.2f}x{ci}"


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
             "| optimizer state |", "|---|---|---|---|---|---|---|---|"]
    for name, r in summary["variants"].items():
        reserved = "n/a on CPU" if r.get("mem_meter") == "process_peak_rss" else _bytes(r.get("peak_reserved_bytes"))
        lines.append(f"| {name} | {r.get('mem_meter') or 'missing'} | {_bytes(r['peak_mem_bytes'])} | {reserved} "
                     f"| {_bytes(r['activation_bytes'])} | {_bytes(r.get('param_bytes'))} "
                     f"| {_bytes(r.get('grad_bytes'))} | {_bytes(r.get('optimizer_state_bytes'))} |")
    return lines


def article_table() -> list[str]:
    lines = [f"The article's own table ({ARTICLE['hardware']}; quoted, not measured here):", "",
             "| precision | memory | img/s | time per epoch |", "|---|---|---|---|"]
    for r in ARTICLE["rows"]:
        lines.append(f"| {r['precision']} | {r['memory']} | {r['imgs_per_s']} | {r['epoch']} |")
    lines += ["", f"The article's claim: {ARTICLE['speedup']} faster, {ARTICLE['memory_change']} memory."]
    return lines


def env_lines(env: dict, runs: dict[str, dict]) -> list[str]:
    gpu = env.get("gpu")
    if gpu:
        yes = {True: "yes", False: "no"}
        hw = (f"{gpu['name']} (compute capability {gpu['capability']}, driver {gpu.get('driver') or 'unknown'}, "
              f"tensor cores: {yes[gpu['tensor_cores']]}, bf16: {yes[gpu['bf16_supported']]})")
    else:
        hw = f"no GPU: CPU {env.get('cpu_model')}, {env.get('cpu_count')} cores (fp16 is emulated on a CPU)"
    first = next(iter(runs.values()))["metrics"] if runs else {}
    tf32 = first.get("tf32") or {}
    strict = tf32.get("matmul_fp32_precision") == "ieee"
    return [f"- Hardware: {hw}",
            f"- Software: torch {env.get('torch')}, CUDA runtime {env.get('cuda_runtime')}, "
            f"cuDNN {env.get('cudnn')}, Python {env.get('python')}",
            f"- FP32 baseline: {'strict IEEE fp32 (TF32 off)' if strict else 'TF32 allowed (allow_tf32: true)'}",
            f"- Model {first.get('arch')}, batch {first.get('batch_size')}, {first.get('epochs')} epochs, "
            f"data {first.get('data_source')} ({first.get('train_images')} train / {first.get('test_images')} test "
            f"images), device {first.get('device')}",
            f"- Code: git commit {first.get('git_commit', 'unknown')}"]


def render(summary: dict, env: dict, runs: dict[str, dict], figures: list[str]) -> str:
    base = summary["baseline"]
    lines = ["# ampbench report: what FP16 mixed precision bought here", ""]
    lines += ["## Results (measured in this run)", ""] + results_table(summary) + [""]
    lines += [
        "How to read it: img/s is training throughput after the warm-up steps, data loading included, evaluation "
        "excluded, device synchronised; in brackets the throughput at the p90 and p10 step times. TFLOP/s is "
        "model FLOPs (forward + backward, torch.utils.flop_counter) times img/s; on a known GPU, against the "
        "datasheet's dense peak for that precision (a datasheet figure, not measured). Peak memory is "
        + ("CUDA peak allocated" if env.get("gpu") else "the process's peak RSS (on a CPU it mostly counts the "
           "process and data, not the model)")
        + "; activations are the bytes autograd saves for backward in one forward pass of one micro-batch. "
        + (f"Ratios are against `{base}`." if base else "No fp32 variant ran, so there are no ratios."), ""]
    methods = sorted({r["speedup_ci_method"] for r in summary["variants"].values() if r.get("speedup_ci_method")})
    if methods:
        lines += [f"Speedup interval: {'; '.join(methods)}.", ""]
    lines += ["## Memory, meter by meter", ""] + memory_table(summary) + [""]
    lines += ["Peak: CUDA `max_memory_allocated` after `reset_peak_memory_stats` at the start of training "
              "(reserved: what the caching allocator held), or on a CPU the process's peak RSS, which counts "
              "the interpreter and the data set too. Activations: bytes saved for backward, counted with "
              "saved-tensor hooks, each storage once; this is where fp16 saves memory, and it is comparable "
              "across devices. Parameters, gradients and the optimizer's momentum stay fp32 in every variant.", ""]
    lines += ["## The article's figures, beside ours", ""] + article_table() + [""]
    if figures:
        lines += ["## Figures", ""] + [f"![{Path(f).stem}]({f})" for f in figures] + [""]
    lines += ["## Environment", ""] + env_lines(env, runs) + [""]
    lines += ["## Reproduce", "", "```", "dvc repro          # or: make repro", "```", ""]
    return "\n".join(lines)


def make_figures(runs: dict[str, dict], fig_dir: Path) -> list[Path]:
    """Throughput with spread, and accuracy/loss per epoch; returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    written = []
    names = list(runs)
    med, lo, hi = [], [], []
    for n in names:
        m = runs[n]["metrics"]
        st = m.get("step_time_ms") or {}
        bs = m.get("batch_size") or 0
        ok = st.get("median") and st.get("p10") and st.get("p90")
        med.append(bs / st["median"] * 1000 if ok else 0)
        lo.append(bs / st["p90"] * 1000 if ok else 0)
        hi.append(bs / st["p10"] * 1000 if ok else 0)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    spread = [[m - lw for m, lw in zip(med, lo, strict=True)], [h - m for m, h in zip(med, hi, strict=True)]]
    ax.bar(names, med, yerr=spread, capsize=4)
    ax.set_ylabel("images / s (median step, p10-p90 bars)")
    ax.set_title("Training throughput per variant")
    fig.tight_layout()
    path = fig_dir / "throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for n in names:
        h = runs[n]["history"]
        ep = [int(r["epoch"]) for r in h]
        a1.plot(ep, [float(r["eval_acc"]) * 100 for r in h], marker="o", label=n)
        a2.plot(ep, [float(r["train_loss"]) for r in h], marker="o", label=n)
    a1.set_xlabel("epoch")
    a1.set_ylabel("eval accuracy (%)")
    a2.set_xlabel("epoch")
    a2.set_ylabel("train loss")
    a1.legend()
    fig.suptitle("Accuracy and loss per epoch")
    fig.tight_layout()
    path = fig_dir / "curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def build(runs_dir: Path, env: dict, report_md: Path, summary_json: Path, fig_dir: Path,
          variants: list[str]) -> dict:
    """Write report.md, summary.json and figures from the runs on disk; return the summary.

    Only ``variants`` (those in params.yaml, in its order) are reported: a folder
    left behind by a variant since removed is not this run's result.
    """
    found = read_runs(runs_dir)
    runs = {name: found[name] for name in variants if name in found}
    if not runs:
        from ampbench.errors import DataError
        raise DataError(f"no finished runs under {runs_dir}; run the train stages first (dvc repro)")
    summary = summarize(runs)
    figures = make_figures(runs, fig_dir)
    rel = [Path(os.path.relpath(f, report_md.parent)).as_posix() for f in figures]
    atomic_write(report_md, render(summary, env, runs, rel))
    write_json(summary_json, summary)
    return summary
