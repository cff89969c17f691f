"""How the report writes a number: values, ratios, changes, shares, times and bytes, each in one place.

A value that was not measured is written as ``missing`` (a measurement) or ``n/a`` (a ratio or share that
has nothing to be taken against); never as 0.
"""

from __future__ import annotations

from ampbench import precision as rungs
from ampbench.errors import ANALYSES

MIB = 2 ** 20
GIB = 2 ** 30


def num(value, spec: str, missing: str = "missing") -> str:
    """``value`` in format ``spec`` (e.g. ",.0f", ".2%", "d"), or ``missing``."""
    return missing if value is None else format(value, spec)


def ratio(r: float) -> str:
    """A ratio with enough digits to tell small ones apart: 3.21, 0.95, 0.0213."""
    return f"{r:.2f}" if r >= 0.1 else f"{r:.3g}"


def times(r: float | None) -> str:
    """A ratio as a factor: 3.21x; n/a when there is none."""
    return "n/a" if r is None else f"{ratio(r)}x"


def change(r: float | None) -> str:
    """A ratio as a change: 0.6 -> -40%; n/a when there is none."""
    return "n/a" if r is None else f"{(r - 1) * 100:+.0f}%"


def pct(v: float | None) -> str:
    """A share: 0.42 -> 42%; n/a when there is none."""
    return "n/a" if v is None else f"{v:.0%}"


def ms(v: float | None) -> str:
    """A time in milliseconds to three figures: 0.398 ms; n/a when there is none."""
    if v is None:
        return "n/a"
    return f"{v:,.0f} ms" if v >= 1000 else f"{v:.3g} ms"


def points(diff: float | None) -> str:
    """An accuracy difference in percentage points: -0.0100 -> -1.00 pts."""
    return "n/a" if diff is None else f"{diff * 100:+.2f} pts"


def against(c: dict) -> str:
    """A comparison's throughput ratio and final-accuracy difference (``throughput_ratio``, ``acc_diff``): "0.93x
    the throughput, final accuracy +0.10 points"."""
    speed = f"{c['throughput_ratio']:.2f}x the throughput" if c["throughput_ratio"] else "throughput n/a"
    return speed + (f", final accuracy {c['acc_diff'] * 100:+.2f} points" if c["acc_diff"] is not None else "")


def size(n: int | None) -> str:
    """Bytes in the largest binary unit that keeps them at 1 or more: 1.50 GiB, 12.00 MiB, 512 B."""
    if n is None:
        return "missing"
    for unit, step in (("GiB", GIB), ("MiB", MIB), ("KiB", 2 ** 10)):
        if n >= step:
            return f"{n / step:.2f} {unit}"
    return f"{n} B"


def faster(speedup: float | None) -> str:
    """A speedup in words: 2.00x faster, 1.25x slower (a ratio below 1 read as how many times slower); n/a."""
    if speedup is None:
        return "n/a"
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"


def label(r: dict) -> str:
    """A summary row's precision as people say it: FP16-AMP, BF16-AMP, FP32 (its rung's label); ", eager" where a
    rung fast only compiled ran uncompiled."""
    p = r.get("precision")
    return (rungs.label(p) if p in rungs.RUNGS else str(p).upper()) + (", eager" if r.get("eager") else "")


def spread_judged(r: dict, base: dict) -> tuple[bool, float]:
    """Whether a variant's accuracy difference lies within run-to-run spread (under twice the larger sd of the two
    variants over repeats), and that sd; (False, 0) where either ran once."""
    spread = max(r.get("final_acc_std") or 0, base.get("final_acc_std") or 0)
    return bool(spread) and abs(r.get("acc_diff") or 0) <= 2 * spread, spread


def speedup(row: dict) -> str:
    """A summary row's speedup with its 95% interval where it has one: 1.52x (1.48 to 1.57); n/a without."""
    if row.get("speedup") is None:
        return "n/a"
    lo, hi = row.get("speedup_ci95") or [None, None]
    ci = f" ({ratio(lo)} to {ratio(hi)})" if lo is not None and hi is not None else ""
    return f"{times(row['speedup'])}{ci}"


def precision(row: dict) -> str:
    """A summary row's precision, ``fp8 (eager)`` where a rung fast only compiled ran uncompiled."""
    return f"{row['precision']} (eager)" if row.get("eager") else str(row["precision"])


def named(name: str, row: dict) -> str:
    """A variant with its precision where its name does not say it: ``amp (fp16)``, ``fp32``."""
    return name if name == precision(row) else f"{name} ({precision(row)})"


def activations(r: dict) -> str:
    """A variant's activation bytes; "(eager)" after those of a compiled run, which the probe counts on the eager
    model (Inductor may save fewer, or other, tensors for the backward)."""
    return size(r.get("activation_bytes")) + (" (eager)" if r.get("compiled") else "")


def eager_note(summary: dict) -> list[str]:
    """What an eager figure means, once, where any variant's is."""
    eager = [n for n, r in summary["variants"].items() if r.get("eager")]
    if not eager:
        return []
    return [f"Eager: {', '.join(f'`{n}`' for n in eager)} ran without torch.compile (on a CPU always; on a GPU with "
            "train.compile: false), and torchao's low-precision training is fast only compiled (it fuses the "
            "scaling and casts into few kernels): its speed here is not what it buys compiled, and the roofline's "
            "roofline counts it compiled.", ""]


def not_made(summary: dict, *analyses: str) -> list[str]:
    """One line per variant for which an analysis could not be made, with why (``errors.analysis``)."""
    lines = [f"{ANALYSES[a][0].upper()}{ANALYSES[a][1:]} could not be made for `{n}`: {why}."
             for a in analyses for n, r in summary["variants"].items() if (why := (r.get("not_made") or {}).get(a))]
    return lines + [""] if lines else []


def windows(paired: dict) -> str:
    """The paired check's windows: sized by time per variant (``steps`` a dict), or a fixed step count."""
    steps = paired.get("steps")
    if not isinstance(steps, dict):
        return f"{steps} optimizer steps"
    each = ", ".join(f"`{n}` {k}" for n, k in steps.items())
    return (f"at least {paired.get('window_s', 0):g} s and {paired.get('min_steps', 1)} optimizer steps "
            f"({each} steps)")


def same_arithmetic(row: dict) -> bool:
    """The paired check found the variant computing strict FP32's very arithmetic on this device (tf32 on a CPU):
    its ratio is noise, not a speed difference."""
    return bool((row.get("paired") or {}).get("same_arithmetic"))


def dtype(name: str) -> str:
    """A torch dtype's name as the ladder's rungs say it: float32 fp32, bfloat16 bf16, float16 fp16, float8_e4m3fn
    float8."""
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "float8"}.get(name, name)
