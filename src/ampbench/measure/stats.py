"""The statistics of measured times and rates: percentiles, mean and spread, and the 95% intervals of a
ratio (a bootstrap over one process's step times, or a t-interval over repeated runs), and the sign test's
p-value. numpy at import, no torch, so the report can use it without importing training code; the intervals and
the test call ``scipy.stats``, imported inside them (see ``_scipy_stats``).
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


def _scipy_stats():
    """``scipy.stats``, imported on first use: the train, sweep and paired stages import this module on GPU
    machines that have torch, numpy and pyyaml but no scipy, and never call what needs it."""
    import scipy.stats

    return scipy.stats


def _ratio_of_means(base: np.ndarray, other: np.ndarray, axis: int = -1) -> np.ndarray:
    return base.mean(axis=axis) / other.mean(axis=axis)


def bootstrap_ratio_ci(base: list[float], other: list[float], *, rounds: int = 2000,
                       level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Confidence interval of mean(base) / mean(other) by resampling both sets (percentile bootstrap,
    ``scipy.stats.bootstrap`` over the two independent samples, ``rounds`` resamples).

    With step times, base = fp32 times and other = a variant's times gives the
    variant's speedup.
    """
    if not len(base) or not len(other):
        return math.nan, math.nan
    # scipy wants two values a sample; one value resamples to itself, as [x, x] does
    samples = [np.asarray(v, dtype=np.float64) for v in (base, other)]
    samples = [np.repeat(v, 2) if v.size == 1 else v for v in samples]
    res = _scipy_stats().bootstrap(samples, _ratio_of_means, n_resamples=rounds, vectorized=True, paired=False,
                                   confidence_level=level, method="percentile", rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def t975(df: int) -> float:
    """The two-sided 95% Student t quantile for ``df`` degrees of freedom (NaN below 1). The 3-decimal table this
    replaced gave 1.96 past 30 degrees, the normal's quantile; scipy's exact value is the right one (2.021 at 40),
    so an interval over 32 or more repeats is now a little wider, and no narrower than its data allow."""
    return float(_scipy_stats().t.ppf(0.975, df))


def ratio_ci_from_repeats(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """mean(num) / mean(den) with a 95% interval from independent repeats (delta method on the log ratio).

    With throughputs, num = a variant's img/s per repeat and den = the baseline's gives the speedup.
    """
    (mn, sn), (md, sd) = mean_std(num), mean_std(den)
    ratio = mn / md
    se = math.sqrt(sn ** 2 / (len(num) * mn ** 2) + sd ** 2 / (len(den) * md ** 2))
    t = t975(min(len(num), len(den)) - 1)
    return ratio, ratio * math.exp(-t * se), ratio * math.exp(t * se)


def mean_ci(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """The t-interval of the mean of ``values`` (``scipy.stats.t.interval``; two or more values)."""
    mean, sd = mean_std(values)
    if sd == 0:  # every run the same: no spread to widen it (scipy would give NaN)
        return mean, mean
    lo, hi = _scipy_stats().t.interval(level, len(values) - 1, loc=mean, scale=sd / math.sqrt(len(values)))
    return float(lo), float(hi)


def sign_test_p(agree: int, rounds: int) -> float:
    """Two-sided sign test (``scipy.stats.binomtest``, p = 1/2): the chance that ``agree`` of ``rounds`` rounds
    or a split as lopsided says one side when neither is faster; all 6 of 6: 2 x 2^-6 = 3%."""
    return float(_scipy_stats().binomtest(agree, rounds, 0.5, alternative="two-sided").pvalue)
