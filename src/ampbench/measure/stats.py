"""The statistics of measured times and rates: percentiles, mean and spread, and the 95% intervals of a
ratio (a bootstrap over one process's step times, or a t-interval over repeated runs). numpy only, no torch,
so the report can use it without importing training code.
"""

from __future__ import annotations

import math

import numpy as np


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated; NaN for no values."""
    return float(np.percentile(values, q)) if len(values) else math.nan


def summarize_ms(values: list[float]) -> dict:
    """Median and p10/p90 of step times in milliseconds."""
    return {"median": percentile(values, 50), "p10": percentile(values, 10),
            "p90": percentile(values, 90), "n": len(values)}


def rate_spread(rates: list[float]) -> list[float] | None:
    """The p10 and p90 of per-step rates (img/s): the spread of a throughput; None without rates."""
    return [percentile(rates, 10), percentile(rates, 90)] if rates else None


# A run is steady when its fixed-shape steps, the same work each, take about the same time. Past these limits the
# machine changed under it (another tenant, a throttled clock), and its ratio to another stage says that, not the
# precision (docs/results.md: a quiet machine's figures against a busy one's).
SPREAD_LIMIT = 1.5   # p90 / p10 of the step times: a tenth of the steps at least 1.5x slower than another tenth
DRIFT_LIMIT = 1.25   # the last third's median step time over the first third's (or its inverse)
CLOCK_LIMIT = 1.05   # p90 / p10 of the GPU's SM clock samples during training


def steadiness(step_ms: list[float], clock_p10_p90: list[float] | None = None) -> dict | None:
    """How steady a run's timed steps were: their spread (p90 / p10), their drift (the last third's median over
    the first third's), the SM clock's spread, and ``unsteady``: each measure past its limit, in words; None for
    fewer than 6 steps."""
    if len(step_ms) < 6:
        return None
    third = len(step_ms) // 3
    spread = percentile(step_ms, 90) / percentile(step_ms, 10)
    drift = float(np.median(step_ms[-third:]) / np.median(step_ms[:third]))
    clock = clock_p10_p90[1] / clock_p10_p90[0] if clock_p10_p90 and clock_p10_p90[0] else None
    unsteady = []
    if spread > SPREAD_LIMIT:
        unsteady.append(f"its step times spread {spread:.2f}x from p10 to p90 (limit {SPREAD_LIMIT})")
    if max(drift, 1 / drift) > DRIFT_LIMIT:
        unsteady.append(f"its steps ran {fmt_drift(drift)} by the last third of training than in the first "
                        f"(limit {DRIFT_LIMIT}x)")
    if clock and clock > CLOCK_LIMIT:
        unsteady.append(f"the GPU's SM clock moved {clock:.2f}x from p10 to p90 (limit {CLOCK_LIMIT})")
    return {"spread": spread, "drift": drift, "clock_spread": clock, "unsteady": unsteady}


def fmt_drift(drift: float) -> str:
    """A drift in step time as words: 2.00x slower, 1.30x faster."""
    return f"{drift:.2f}x slower" if drift >= 1 else f"{1 / drift:.2f}x faster"


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not values:
        return math.nan, math.nan
    if len(values) == 1:
        return float(values[0]), 0.0
    return float(np.mean(values)), float(np.std(values, ddof=1))


def bootstrap_ratio_ci(base: list[float], other: list[float], *, rounds: int = 2000,
                       level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Confidence interval of mean(base) / mean(other) by resampling both sets (percentile bootstrap).

    With step times, base = fp32 times and other = a variant's times gives the
    variant's speedup.
    """
    if not len(base) or not len(other):
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    b, o = np.asarray(base, dtype=np.float64), np.asarray(other, dtype=np.float64)
    ratios = (b[rng.integers(0, len(b), (rounds, len(b)))].mean(axis=1)
              / o[rng.integers(0, len(o), (rounds, len(o)))].mean(axis=1))
    alpha = (1 - level) / 2 * 100
    return float(np.percentile(ratios, alpha)), float(np.percentile(ratios, 100 - alpha))


# two-sided 95% Student t quantiles by degrees of freedom (1..30); 1.96 beyond
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042]


def t975(df: int) -> float:
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


def ratio_ci_from_repeats(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """mean(num) / mean(den) with a 95% interval from independent repeats (delta method on the log ratio).

    With throughputs, num = a variant's img/s per repeat and den = the baseline's gives the speedup.
    """
    (mn, sn), (md, sd) = mean_std(num), mean_std(den)
    ratio = mn / md
    se = math.sqrt(sn ** 2 / (len(num) * mn ** 2) + sd ** 2 / (len(den) * md ** 2))
    t = t975(min(len(num), len(den)) - 1)
    return ratio, ratio * math.exp(-t * se), ratio * math.exp(t * se)
