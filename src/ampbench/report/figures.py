"""Every figure of the report (PNG, labelled axes and units), from the run files and the summary only.

``draw(summary, runs, fig_dir)`` draws them all and returns the files written (MLflow logs those files) and the
figures that could not be drawn, with why: a figure is an analysis, and one that fails stops nothing.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ampbench.errors import analysis  # noqa: E402
from ampbench.report.fmt import MIB  # noqa: E402
from ampbench.report.summary import profile_categories, sweep_memory  # noqa: E402


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput(runs: dict[str, dict], path: Path) -> Path:
    """img/s per variant (timed images over summed step time), with bars from the p10 to the p90 step's rate."""
    names, med, lo, hi = [], [], [], []
    for name, run in runs.items():
        m = run["metrics"]
        if m.get("imgs_per_s") and m.get("imgs_per_s_p10_p90"):
            names.append(name)
            med.append(m["imgs_per_s"])
            lo.append(m["imgs_per_s_p10_p90"][0])
            hi.append(m["imgs_per_s_p10_p90"][1])
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    spread = [[max(0.0, m - v) for m, v in zip(med, lo, strict=True)],
              [max(0.0, v - m) for m, v in zip(med, hi, strict=True)]]
    bars = ax.bar(names, med, yerr=spread, capsize=4, color="#4c72b0")
    ax.bar_label(bars, labels=[f"{m:,.0f}" for m in med], padding=2, fontsize=8)
    if med and min(med) > 0 and max(med) / min(med) > 20:
        ax.set_yscale("log")  # else a 50x gap hides the slower bars
    ax.set_ylabel("images / s")
    ax.set_title("Training throughput (bars: p10 to p90 of the steps' rates)")
    return _save(fig, path)


def memory(runs: dict[str, dict], path: Path) -> Path:
    """Per variant: what the model holds (parameters, gradients, optimizer state, activations), and the peak."""
    names = list(runs)
    parts = [("param_bytes", "parameters"), ("grad_bytes", "gradients"), ("optimizer_state_bytes", "optimizer state"),
             ("activation_bytes", "activations (one micro-batch)")]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.5, 3.8))
    bottom = [0.0] * len(names)
    for key, label in parts:
        vals = [(runs[n]["metrics"].get(key) or 0) / MIB for n in names]
        a1.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    a1.set(ylabel="MiB", title="Model memory by part (counted)")
    a1.legend(fontsize=7)
    meter = next(iter(runs.values()))["metrics"].get("mem_meter") or "peak"
    a2.bar(names, [(runs[n]["metrics"].get("peak_mem_bytes") or 0) / MIB for n in names], color="#555555")
    a2.set(ylabel="MiB", title=f"Measured peak ({meter})")
    return _save(fig, path)


def curves(runs: dict[str, dict], path: Path) -> Path:
    """Evaluation accuracy and training loss per epoch, all variants on one plot each."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    styles = ["-", "--", ":", "-."]  # variants that learn alike overlap: dashes keep each one visible
    for i, (name, run) in enumerate(runs.items()):
        h = run["history"]
        ep = [int(r["epoch"]) for r in h]
        style = dict(marker="o", linestyle=styles[i % len(styles)], label=name)
        a1.plot(ep, [float(r["eval_acc"]) * 100 for r in h], **style)
        a2.plot(ep, [float(r["train_loss"]) for r in h], **style)
    a1.set(xlabel="epoch", ylabel="eval accuracy (%)", title="Accuracy per epoch")
    a2.set(xlabel="epoch", ylabel="train loss (cross-entropy)", title="Loss per epoch")
    for ax in (a1, a2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    a1.legend()
    return _save(fig, path)


def loss_scale(runs: dict[str, dict], path: Path) -> Path:
    """The fp16 loss scale over optimizer steps, skipped (overflow) steps marked."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for name, run in runs.items():
        rows = run["scale"]
        if not rows:
            continue
        steps = [int(r["step"]) for r in rows]
        scales = [float(r["scale"]) for r in rows]
        last_step = int(run["metrics"].get("optimizer_steps") or steps[-1])
        line, = ax.step(steps + [last_step], scales + [scales[-1]], where="post", label=name)
        skipped = [(s, v) for s, v, r in zip(steps, scales, rows, strict=True) if r["skipped"] == "True"]
        if skipped:
            ax.plot(*zip(*skipped, strict=True), "x", color=line.get_color(), markersize=8)
    ax.set_yscale("log", base=2)
    ax.set(xlabel="optimizer step", ylabel="loss scale", title="fp16 loss scale (x: skipped overflow steps)")
    if ax.lines:
        ax.legend()
    return _save(fig, path)


def grad_norm(runs: dict[str, dict], path: Path) -> Path | None:
    """The gradient norm before clipping per optimizer step, every variant that recorded it, the clip marked."""
    recorded = {n: r for n, r in runs.items() if r.get("grad_norm")}
    if not recorded:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.4))
    clips = set()
    for name, run in recorded.items():
        rows = [(int(r["step"]), float(r["grad_norm"])) for r in run["grad_norm"]]
        ax.plot(*zip(*[(s, v) for s, v in rows if math.isfinite(v)] or [(0, float("nan"))], strict=True),
                linewidth=1, label=name)
        if run["metrics"].get("clip_grad_norm"):
            clips.add(float(run["metrics"]["clip_grad_norm"]))
    for c in sorted(clips):
        ax.axhline(c, color="black", linestyle="--", linewidth=1, label=f"clip_grad_norm {c:g}")
    ax.set_yscale("log")
    ax.set(xlabel="optimizer step", ylabel="total gradient norm",
           title="Gradient norm before clipping (skipped fp16 steps left out)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def audit(runs: dict[str, dict], path: Path) -> Path | None:
    """Per layer of the first audited variant: gradient values lost to fp16, unscaled and at the scale in use."""
    name = next((n for n, r in runs.items() if r["numerics"]), None)
    if name is None:
        return None
    rows = runs[name]["numerics"]
    scale = runs[name]["metrics"].get("final_loss_scale")
    layers = [f"{r['layer']} {r['type']}" for r in rows]
    x = range(len(layers))
    fig, ax = plt.subplots(figsize=(max(7, len(layers) * 0.18), 3.8))
    for key, label in (("grad_underflow", "flush to zero, unscaled"), ("grad_subnormal", "subnormal, unscaled"),
                       ("grad_scaled_underflow", f"flush to zero at scale {scale:g}"),
                       ("grad_scaled_overflow", f"overflow at scale {scale:g}")):
        ax.plot(x, [float(r[key]) * 100 if r.get(key) not in ("", None) else float("nan") for r in rows],
                marker=".", label=label)  # nan: a frozen layer, which no gradient reaches
    ax.set_xticks(list(x), layers, rotation=90, fontsize=6)
    ax.set(ylabel="% of gradient values", title=f"fp16 numerics audit of {name}, per layer (execution order)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def profile(runs: dict[str, dict], path: Path) -> Path | None:
    """Time per step by op category (torch.profiler), every profiled variant side by side, stacked."""
    profiled = {n: r["metrics"]["profile"] for n, r in runs.items() if (r["metrics"].get("profile") or {}).get(
        "categories")}
    if not profiled:
        return None
    fig, ax = plt.subplots(figsize=(9.5, 1.6 + 0.55 * len(profiled)))
    names = list(profiled)
    left = [0.0] * len(names)
    colors = plt.get_cmap("tab10")
    for i, cat in enumerate(profile_categories(list(profiled.values()))):
        widths = [p["categories"].get(cat, {}).get("ms_per_step", 0.0) for p in profiled.values()]
        if any(widths):
            ax.barh(names, widths, left=left, label=cat, color=colors(i % 10))
            left = [a + b for a, b in zip(left, widths, strict=True)]
    walls = [p["wall_ms_per_step"] for p in profiled.values()]
    for y, (total, wall) in enumerate(zip(left, walls, strict=True)):
        ax.text(max(total, wall), y, f" {wall:,.1f} ms wall", va="center", fontsize=8)
    if max(left) / max(1e-9, min(left)) > 20:
        ax.set_xscale("log")
    else:
        ax.set_xlim(0, max(left + walls) * 1.2)  # room for the wall-time labels
    ax.invert_yaxis()
    basis = next(iter(profiled.values()))["basis"]
    ax.set_xlabel(f"ms per optimizer step ({basis})")
    ax.set_title("Where each step's time went (torch.profiler, after training)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)



def _batch_axis(ax, s: dict) -> None:
    batches = sorted({p["batch_size"] for pts in s["points"].values() for p in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch size (images per step)")


def sweep(s: dict | None, fig_dir: Path) -> list[Path]:
    """Throughput and memory against batch size, a line per precision; none when the sweep did not run."""
    if not s:
        return []
    meter = "CUDA peak allocated" if s["device"] == "cuda" else "activations"
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for prec, pts in s["points"].items():
        ok = [p for p in pts if not p.get("oom") and p.get("imgs_per_s")]
        ax.plot([p["batch_size"] for p in ok], [p["imgs_per_s"] for p in ok], marker="o", label=prec)
    _batch_axis(ax, s)
    ax.set_ylabel("images / s")
    ax.set_title(f"Throughput against batch size ({s['steps']} timed steps per point)")
    ax.legend(fontsize=8)
    made = [_save(fig, fig_dir / "sweep_throughput.png")]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    top = 0.0
    for prec, pts in s["points"].items():
        ok = [p for p in pts if not p.get("oom") and sweep_memory(p, s["device"])]
        ys = [sweep_memory(p, s["device"]) / MIB for p in ok]
        top = max([top, *ys])
        ax.plot([p["batch_size"] for p in ok], ys, marker="o", label=prec)
    limit = next((r["limit_bytes"] for r in s["largest"].values() if r.get("limit_bytes")), None)
    if limit and limit / MIB < 20 * max(top, 1e-9):  # the limit, where it fits on the same axis
        ax.axhline(limit / MIB, color="black", linestyle="--", linewidth=1, label="memory limit")
    elif limit:
        ax.set_title(f"limit {limit / 2**30:.0f} GiB: far above", loc="right", fontsize=8)
    _batch_axis(ax, s)
    ax.set_ylabel("MiB")
    ax.set_title(f"Memory against batch size: {meter}", loc="left", fontsize=9)
    ax.legend(fontsize=8)
    made.append(_save(fig, fig_dir / "sweep_memory.png"))
    return made


def draw(summary: dict, runs: dict[str, dict], fig_dir: Path) -> tuple[list[Path], dict[str, str]]:
    """Every figure of the report into ``fig_dir``: the files written, and the figures that could not be drawn
    (file name -> why; each one warned of, the others drawn)."""
    model = next((r["metrics"].get("model") for r in runs.values()), "the model")
    made, failed = [], {}
    for draw_one, name in ((throughput, "throughput.png"), (memory, "memory.png"), (curves, "curves.png"),
                           (loss_scale, "loss_scale.png"), (grad_norm, "grad_norm.png"),
                           (audit, "numerics_audit.png"), (profile, "profile.png")):
        path, why = analysis("figures", f"{model} ({name})", draw_one, runs, fig_dir / name)
        made.append(path)
        if why:
            failed[name] = why
            plt.close("all")
    swept, why = analysis("figures", f"{model} (sweep figures)", sweep, summary.get("sweep"), fig_dir)
    if why:
        failed["sweep_throughput.png and sweep_memory.png"] = why
        plt.close("all")
    return [p for p in made if p is not None] + (swept or []), failed
