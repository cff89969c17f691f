"""Why a variant was (or was not) faster, in the report's words: from the step profiles and the epoch times.

- ``compare``: per op category, how much faster (or slower) the fp16 variant ran than the fp32 baseline, and the
  best speedup AMP could reach if only the tensor-core categories sped up (an Amdahl bound from the fp32 profile).
- ``why``: the verdict's sentence built from that comparison.
- ``time_to_accuracy``: training time (summed epoch times, evaluation excluded) to a target accuracy.
"""

from __future__ import annotations

from ampbench.profiling import CATEGORIES, TENSOR_CORE


def time_to_accuracy(history: list[dict], target: float) -> tuple[float, int] | None:
    """(seconds, epoch) when eval accuracy first reached ``target``, summing epoch times; None if never."""
    total = 0.0
    for row in history:
        total += float(row["epoch_time_s"])
        if float(row["eval_acc"]) >= target:
            return total, int(row["epoch"])
    return None


def compare(base: dict, run: dict, peak_ratio: float | None = None) -> dict | None:
    """Category by category, base ms / run ms; and the Amdahl bounds from the base profile."""
    bp, rp = base.get("profile") or {}, run.get("profile") or {}
    if not bp.get("categories") or not rp.get("categories"):
        return None
    rows = {}
    for cat in CATEGORIES:
        b = bp["categories"].get(cat, {}).get("ms_per_step")
        r = rp["categories"].get(cat, {}).get("ms_per_step")
        if b or r:
            rows[cat] = {"base_ms": b or 0.0, "ms": r or 0.0, "speedup": b / r if b and r else None}
    tc = bp["categories"].get(TENSOR_CORE, {}).get("ms_per_step", 0.0)
    share = tc / bp["wall_ms_per_step"] if bp["wall_ms_per_step"] else 0.0
    out = {"categories": rows, "tensor_core_share": share,
           "amdahl_bound": 1 / (1 - share) if share < 1 else None,
           "step_speedup": bp["wall_ms_per_step"] / rp["wall_ms_per_step"] if rp["wall_ms_per_step"] else None}
    if peak_ratio:
        out["peak_ratio"] = peak_ratio
        out["amdahl_bound_at_peak"] = 1 / ((1 - share) + share / peak_ratio)
    return out


def _x(v: float) -> str:
    return f"{v:.2f}x" if v >= 0.1 else f"{v:.3g}x"


def why(name: str, base_name: str, cmp: dict) -> str:
    """One or two sentences: which categories got faster and by how much, which did not, and the bound."""
    cats = {c: r for c, r in cmp["categories"].items()
            if r["speedup"] is not None and r["base_ms"] > 0 and c != "other"}
    big = sorted(cats, key=lambda c: -max(cats[c]["base_ms"], cats[c]["ms"]))[:3]  # where the time is

    def change(sp: float) -> str:
        return f"{sp:.2f}x faster" if sp >= 1 else f"{1 / sp:.3g}x slower"

    parts = [f"{c} {change(cats[c]['speedup'])} ({cats[c]['base_ms']:.3g} -> {cats[c]['ms']:.3g} ms)" for c in big]
    text = (f"The step profile ({name} against {base_name}, ms per step) says where: " + ", ".join(parts) + ".")
    added = []
    for c in ("casts", "loss scaling"):  # the work fp16 brings with it
        row = cmp["categories"].get(c)
        if row and row["ms"] > row["base_ms"]:
            added.append(f"{row['ms'] - row['base_ms']:.3g} ms of {c}")
    if added:
        text += f" {name} added " + " and ".join(added) + " per step."
    bound = cmp.get("amdahl_bound")
    if bound:
        text += (f" Convolutions and matmuls were {cmp['tensor_core_share']:.0%} of the fp32 step, so even if "
                 f"tensor cores made them free the step could be at most {_x(bound)} faster (an Amdahl bound")
        if cmp.get("amdahl_bound_at_peak"):
            text += (f"; {_x(cmp['amdahl_bound_at_peak'])} at the datasheet's {cmp['peak_ratio']:.1f}x fp16/fp32 "
                     "peak ratio")
        text += ")."
    return text


def profile_lines(summary: dict) -> list[str]:
    """The report's profile section: a category table per variant, what changed, and what profiling cost."""
    rows = {n: r for n, r in summary["variants"].items() if (r.get("profile") or {}).get("categories")}
    if not rows:
        return ["No step profile (profile.steps: 0)."]
    names = list(rows)
    first = rows[names[0]]["profile"]
    lines = [f"Time per optimizer step by op category, from torch.profiler over {first['steps']} steps per variant "
             f"after training, on copies of the trained model (never inside a timed step); time is {first['basis']}"
             ", each op's own time (self time), with the dtypes it ran in.", "",
             "| category | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for cat in CATEGORIES:
        cells = []
        for n in names:
            c = rows[n]["profile"]["categories"].get(cat)
            cells.append(f"{c['ms_per_step']:.3g} ms ({c['share']:.0%}; {c['dtypes'] or 'no float inputs'})"
                         if c else "-")
        if any(c != "-" for c in cells):
            lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    lines.append("| step wall time | " + " | ".join(f"{rows[n]['profile']['wall_ms_per_step']:.3g} ms"
                                                   for n in names) + " |")
    if "gpu_busy_fraction" in first:
        lines.append("| GPU busy (kernels / wall) | " + " | ".join(
            f"{rows[n]['profile']['gpu_busy_fraction']:.0%}" for n in names) + " |")
        lines.append("| kernels per step | " + " | ".join(
            f"{rows[n]['profile']['kernels_per_step']:.0f}" for n in names) + " |")
    lines.append("")
    for name, cmp in (summary.get("profile_comparison") or {}).items():
        lines += [why(name, summary["baseline"], cmp), ""]
    if "gpu_busy_fraction" in first:
        idle = [f"{n} {1 - rows[n]['profile']['gpu_busy_fraction']:.0%}" for n in names]
        lines += ["Share of the step the GPU sat idle waiting for the host (launch-bound when large): "
                  + ", ".join(idle) + ".", ""]
    cost = sum(rows[n]["profile"].get("cost_s") or 0 for n in names)
    lines += [f"Profiling cost {cost:.1f} s in all, outside the timed steps (the profiled steps run with the "
              "profiler's overhead, so their wall time is above the timed steps'). Each run's trace is "
              "`profile_trace.json` in its run folder and MLflow run: open it in https://ui.perfetto.dev or "
              "chrome://tracing.", ""]
    return lines


def time_to_accuracy_lines(summary: dict) -> list[str]:
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
            ratio = _x(base / t) if base else "n/a"
            lines.append(f"| {name} | {t:.1f} s | {r['time_to_target_epoch']} | {ratio} |")
    return lines + [""]
