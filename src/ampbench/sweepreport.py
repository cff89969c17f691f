"""The report's batch-size sweep: the section, its two figures and the verdict's sentence, from sweep.json."""

from __future__ import annotations

from pathlib import Path

from ampbench.figures import _save, plt

MIB = 2 ** 20


def summarize(sweep: dict | None) -> dict | None:
    """The sweep as the report shows it: points by precision, the largest batches and their ratio to fp32's."""
    if not sweep or not sweep.get("enabled"):
        return None
    by_prec: dict[str, list[dict]] = {}
    for p in sweep["points"]:
        by_prec.setdefault(p["variant"], []).append(p)
    found = sweep.get("largest") or {}
    largest = {k: dict(found[k]) for k in sweep.get("precisions", found) if k in found}  # swept order; a copy
    base = (largest.get("fp32") or {}).get("largest_batch")
    for row in largest.values():
        row["vs_fp32"] = row["largest_batch"] / base if base and row.get("largest_batch") else None
    return {"device": sweep["device"], "steps": sweep["steps"], "points": by_prec, "largest": largest,
            "reused_points": sweep.get("reused_points"), "measured_points": sweep.get("measured_points")}


def _memory(p: dict, device: str):
    return p.get("peak_mem_bytes") if device == "cuda" else p.get("activation_bytes")


def _batch_axis(ax, s: dict) -> None:
    batches = sorted({p["batch_size"] for pts in s["points"].values() for p in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch size (images per step)")


def figures(s: dict | None, fig_dir: Path) -> list[Path]:
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
        ok = [p for p in pts if not p.get("oom") and _memory(p, s["device"])]
        ys = [_memory(p, s["device"]) / MIB for p in ok]
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


def sentence(s: dict | None) -> str:
    """The verdict's sentence: how much larger a batch fp16 fits than fp32."""
    if not s:
        return ""
    parts = [f"{prec} fits {row['vs_fp32']:.2f}x the batch of fp32 ({row['largest_batch']:,} against "
             f"{s['largest']['fp32']['largest_batch']:,} images{', estimated' if row['method'] == 'estimate' else ''})"
             for prec, row in s["largest"].items() if prec != "fp32" and row.get("vs_fp32")]
    return f" In the batch-size sweep, {'; '.join(parts)}." if parts else ""


def lines(s: dict | None) -> list[str]:
    if not s:
        return []
    cuda = s["device"] == "cuda"
    meter = "CUDA peak allocated" if cuda else "activations (bytes saved for backward; peak RSS says little here)"
    batches = sorted({p["batch_size"] for pts in s["points"].values() for p in pts})
    out = ["## Batch-size sweep", "",
           f"Short timed runs, not training: {s['steps']} optimizer steps per point after 2 untimed ones, a fresh "
           f"model, the engine's step, end-to-end img/s (p10 to p90 step) and {meter}. "
           f"{s['measured_points']} point(s) measured in this run, {s['reused_points']} reused from an earlier "
           "run with the same settings, data, machine and code.", "",
           "| batch | " + " | ".join(s["points"]) + " |", "|---|" + "---|" * len(s["points"])]
    for b in batches:
        cells = []
        for pts in s["points"].values():
            p = next((p for p in pts if p["batch_size"] == b), None)
            if p is None:
                cells.append("-")
            elif p.get("oom"):
                cells.append("out of memory")
            else:
                lo, hi = p.get("imgs_per_s_p10") or 0, p.get("imgs_per_s_p90") or 0
                cells.append(f"{p['imgs_per_s']:,.0f} img/s ({lo:,.0f} to {hi:,.0f}), "
                             f"{(_memory(p, s['device']) or 0) / MIB:,.1f} MiB")
        out.append(f"| {b} | " + " | ".join(cells) + " |")
    out.append("")
    if s["largest"]:
        out += ["Largest batch that fits:", "", "| precision | largest batch | vs fp32 | how | limit |",
                "|---|---|---|---|---|"]
        for prec, r in s["largest"].items():
            ratio = f"{r['vs_fp32']:.2f}x" if r.get("vs_fp32") else "n/a"
            how = f"{r['method']}: {r['how']}"
            limit = f"{r['limit_bytes'] / 2**30:.1f} GiB ({r['limit']})" if r.get("limit_bytes") else "n/a"
            largest = "n/a" if r.get("largest_batch") is None else f"{r['largest_batch']:,}"
            out.append(f"| {prec} | {largest} | {ratio} | {how} | {limit} |")
        if not cuda:
            out += ["", "On a CPU nothing runs out of memory, so these are estimates from the measured bytes per "
                    "image, not measurements; on a GPU the sweep searches for the largest batch that runs."]
        out.append("")
    return out
