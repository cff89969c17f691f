"""The statistics of measured times and rates (measure/stats.py): percentiles, spread, the bootstrap and the
t-intervals of a ratio, the sign test; scipy's figures set against the hand-written ones they replaced."""

from __future__ import annotations

import math

import pytest
import torch

from ampbench.measure import stats


def test_percentiles_match_numpy_linear():
    v = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert stats.percentile(v, 50) == 3.0
    assert stats.percentile(v, 10) == pytest.approx(1.4)
    assert stats.percentile(v, 90) == pytest.approx(4.6)
    assert stats.summarize_ms(v) == {"median": 3.0, "p10": pytest.approx(1.4), "p90": pytest.approx(4.6), "n": 5}


def test_mean_std():
    assert stats.mean_std([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]) == (5.0, pytest.approx(2.138, abs=1e-3))
    assert stats.mean_std([3.0]) == (3.0, 0.0)


def test_bootstrap_interval_brackets_the_true_ratio():
    g = torch.Generator().manual_seed(1)
    base = (10 + torch.randn(400, generator=g)).tolist()
    fast = (5 + 0.5 * torch.randn(400, generator=g)).tolist()
    lo, hi = stats.bootstrap_ratio_ci(base, fast)
    assert lo < 2.0 < hi and hi - lo < 0.2


def test_ratio_interval_from_repeats_matches_hand_computation():
    ratio, lo, hi = stats.ratio_ci_from_repeats([30.0, 32.0, 28.0], [10.0, 11.0, 9.0])
    assert ratio == pytest.approx(3.0)
    se = math.sqrt(2.0 ** 2 / (3 * 30.0 ** 2) + 1.0 ** 2 / (3 * 10.0 ** 2))
    t = 4.302652729749462  # t(0.975, 2 degrees of freedom)
    assert lo == pytest.approx(3.0 * math.exp(-t * se), rel=1e-12)
    assert hi == pytest.approx(3.0 * math.exp(t * se), rel=1e-12)


# The two-sided 95% t quantiles of the hand-written table scipy replaced (df 1..30), to 3 decimals.
OLD_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
            2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
            2.045, 2.042]


def test_t_quantile_is_the_old_table_to_its_three_decimals_and_exact_past_30():
    for df, old in enumerate(OLD_T975, start=1):
        assert abs(stats.t975(df) - old) <= 5e-4 + 1e-12, df  # the table rounded to 3 decimals, no more
    # the table said 1.96 (the normal's quantile) past 30 degrees; the t quantile is wider
    assert stats.t975(40) == pytest.approx(2.021075390306273, rel=1e-12)
    assert stats.t975(10 ** 6) == pytest.approx(1.959966, abs=1e-6)
    assert math.isnan(stats.t975(0))


@pytest.mark.parametrize("num, den, old", [
    ([30.0, 32.0, 28.0], [10.0, 11.0, 9.0], (3.0, 2.225612136877489, 4.0438312906699485)),
    ([101.0, 97.0, 99.0, 103.0, 100.0], [50.0, 52.0, 49.0, 51.0, 48.0], (2.0, 1.9061117804757683, 2.0985128159701074)),
])
def test_ratio_interval_from_repeats_keeps_the_hand_written_figures(num, den, old):
    """The figures the table gave: the bounds are ratio * exp(-+t * se), so a t off by at most 5e-4 (the table's
    rounding) moves log(bound) by at most 5e-4 * se."""
    ratio, lo, hi = stats.ratio_ci_from_repeats(num, den)
    (mn, sn), (md, sd) = stats.mean_std(num), stats.mean_std(den)
    se = math.sqrt(sn ** 2 / (len(num) * mn ** 2) + sd ** 2 / (len(den) * md ** 2))
    assert ratio == pytest.approx(old[0], rel=1e-12)
    assert abs(math.log(lo / old[1])) <= 5e-4 * se + 1e-12
    assert abs(math.log(hi / old[2])) <= 5e-4 * se + 1e-12
    assert lo != old[1]  # scipy's exact quantile, not the table's


BASE_MS = [10.0, 11.0, 9.5, 10.5, 12.0, 9.0, 10.2, 11.3]
FAST_MS = [5.0, 5.5, 4.8, 5.2, 6.0, 4.9]
# The hand-written bootstrap over 1,000,000 resamples (seeds 7 and 8, averaged): the 2.5% and 97.5% points of
# mean(BASE_MS) / mean(FAST_MS) resampled; each within about 0.0002 of the exact bootstrap interval.
REF_LO, REF_HI = 1.82399, 2.17008


def test_bootstrap_ratio_interval_matches_a_large_resample_reference():
    """Monte-Carlo error of a percentile over n resamples: sqrt(q (1 - q) / n) / density; the resampled ratio's
    density there is 0.69 (2.5%) and 0.68 (97.5%), so 0.0005 at 200,000 resamples and 0.005 at 2,000: each
    bound must fall within 4 of those (and the reference's own 0.0002). The basic interval (2 x 1.9944 minus the
    percentile one: 1.818, 2.165) or a 90% one (1.851, 2.144) falls outside."""
    lo, hi = stats.bootstrap_ratio_ci(BASE_MS, FAST_MS, rounds=200_000)
    assert lo == pytest.approx(REF_LO, abs=0.0022) and hi == pytest.approx(REF_HI, abs=0.0022)
    lo, hi = stats.bootstrap_ratio_ci(BASE_MS, FAST_MS)
    assert lo == pytest.approx(REF_LO, abs=0.021) and hi == pytest.approx(REF_HI, abs=0.021)
    lo, hi = stats.bootstrap_ratio_ci(BASE_MS, FAST_MS, rounds=200_000, level=0.9)
    assert lo == pytest.approx(1.8513, abs=0.0022) and hi == pytest.approx(2.1436, abs=0.0022)


def test_bootstrap_draws_as_the_hand_written_loop_did():
    """scipy (pinned) resamples each sample in turn with the seeded Generator's integers, as the loop it replaced
    did, and takes numpy's linear percentiles: the same seed gives the same figures."""
    assert stats.bootstrap_ratio_ci(BASE_MS, FAST_MS) == pytest.approx((1.8273962144666482, 2.16667345276873),
                                                                       rel=1e-12)
    assert stats.bootstrap_ratio_ci([10.0], [5.0]) == (2.0, 2.0)  # one value a side: nothing to resample
    lo, hi = stats.bootstrap_ratio_ci([10.0], FAST_MS, rounds=20_000)
    assert lo < 10 / 5.2333 < hi and lo == pytest.approx(1.79, abs=0.02)
    assert all(math.isnan(x) for x in stats.bootstrap_ratio_ci([], FAST_MS))


def test_sign_test_p_value_is_two_sided():
    assert stats.sign_test_p(6, 6) == pytest.approx(2 * 0.5 ** 6, rel=1e-12)  # the report's "3% by chance"
    assert stats.sign_test_p(0, 6) == pytest.approx(2 * 0.5 ** 6, rel=1e-12)
    assert stats.sign_test_p(5, 6) == pytest.approx(2 * 7 / 64, rel=1e-12)  # 5 or 6 of 6, either way
    assert stats.sign_test_p(3, 6) == pytest.approx(1.0)


def test_mean_ci_is_the_t_interval_of_the_mean():
    """What `ampbench compare` gives a variant run several times: mean +- t(0.975, n - 1) sd / sqrt(n)."""
    lo, hi = stats.mean_ci([1.0, 2.0, 3.0])
    half = 4.302652729749462 / math.sqrt(3)  # sd 1, two degrees of freedom
    assert lo == pytest.approx(2 - half, abs=1e-12) and hi == pytest.approx(2 + half, abs=1e-12)
    assert stats.mean_ci([1.5, 1.5]) == (1.5, 1.5)  # runs alike: the value, not scipy's NaN
