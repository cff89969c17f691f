"""The report's numerical-safety section: the fp16 numerics audit, skipped steps and the loss scale, and the
gradient norms before clipping."""

from __future__ import annotations

import math
import statistics

from ampbench import precision
from ampbench.report import fmt
from ampbench.report.fmt import not_made


def safety(summary: dict, env: dict, runs: dict) -> list[str]:
    """Skipped steps, non-finite losses, the accumulation check and the fp16 audit's layers at risk."""
    lines = ["## Numerical safety", "",
             "Whether low precision lost anything: overflow-skipped steps, non-finite losses, the loss scale, and the "
             "fp16 numerics audit.", "",
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
    graded = [r for r in rows if r.get("grad_underflow") not in ("", None)]  # frozen layers get no gradient
    at_risk = sorted(graded, key=lambda r: -float(r["grad_underflow"]))[:5]
    at_risk = [r for r in at_risk if float(r["grad_underflow"]) > 0 or float(r["act_overflow"]) > 0]
    frozen = sum(str(r.get("frozen")) == "True" for r in rows)
    without = len(rows) - len(graded)
    trained = (f"; {frozen} of them frozen, {without} reached by no gradient (activations only)"
               if frozen or without else "")
    lines = [f"fp16 numerics audit of `{name}` ({len(rows)} layers{trained}; gradients measured in fp32, then "
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
