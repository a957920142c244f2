"""The verdict rule shared by ``infir2 demo`` and ``infir2 fidelity``: t quantiles against published
tables and the normal limit, intervals worked out by hand, and each branch of the rule."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from infir2.tools.paired import EQUIVALENT, INCONCLUSIVE, paired_gaps, paired_verdict, t_quantile

# two-sided 95% critical values of Student's t (any statistics table, e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2)
T_TABLE = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    9: 2.262,
    10: 2.228,
    20: 2.086,
    30: 2.042,
}


@pytest.mark.parametrize("df", sorted(T_TABLE))
def test_t_quantile_matches_the_table(df):
    assert t_quantile(df) == pytest.approx(T_TABLE[df], abs=6e-4)


def test_t_quantile_tends_to_the_normal_one_and_other_levels():
    assert t_quantile(2000) == pytest.approx(statistics.NormalDist().inv_cdf(0.975), abs=2e-3)
    assert t_quantile(4, 0.90) == pytest.approx(2.132, abs=6e-4)  # the table's 90% column
    assert t_quantile(7, 0.99) == pytest.approx(3.499, abs=6e-4)
    with pytest.raises(ValueError, match="df >= 1"):
        t_quantile(0)


def test_t_interval_covers_the_mean_95_percent_of_the_time():
    """A property of the interval, by simulation: 4 normal gaps per trial, true mean 0.7."""
    rng = random.Random(0)
    trials, hits = 4000, 0
    for _ in range(trials):
        v = paired_verdict([rng.gauss(0.7, 1.0) for _ in range(4)], margin=1.0, higher_is_better=False)
        hits += v.low <= 0.7 <= v.high
    assert abs(hits / trials - 0.95) < 0.015


def test_interval_by_hand():
    v = paired_verdict([1.0, 0.0, 0.5], margin=5.0, higher_is_better=False)
    half = 4.303 * 0.5 / math.sqrt(3)  # t(2) * sd / sqrt(n); sd of (1, 0, 0.5) is 0.5
    assert v.mean == pytest.approx(0.5) and v.sd == pytest.approx(0.5) and v.n == 3
    assert (v.low, v.high) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-3)
    assert v.label == EQUIVALENT  # [-0.74, 1.74] inside +-5


def test_the_rule_branch_by_branch():
    loss = dict(margin=1.0, higher_is_better=False)
    assert paired_verdict([0.1, 0.2, 0.15], **loss).label == EQUIVALENT  # tight, inside the margin
    # resolved as nonzero, but inside the margin: equivalent is checked first
    assert paired_verdict([0.3, 0.31, 0.32], **loss).label == EQUIVALENT
    assert paired_verdict([3.0, 3.2, 2.9], **loss).label == "worse"  # a higher loss, resolved
    assert paired_verdict([-3.0, -3.2, -2.9], **loss).label == "better"
    assert paired_verdict([2.0, -2.0, 1.0], **loss).label == INCONCLUSIVE  # straddles 0 and the margin
    acc = dict(margin=3.0, higher_is_better=True)
    assert paired_verdict([-10.0, -8.0, -12.0], **acc).label == "worse"  # lower accuracy is worse
    assert paired_verdict([0.0, 0.0, 0.0], **acc).label == EQUIVALENT  # identical runs
    one = paired_verdict([0.0], **acc)
    assert one.label == INCONCLUSIVE and one.sd is None and math.isnan(one.low)  # one seed: no interval
    with pytest.raises(ValueError, match="margin must be positive"):
        paired_verdict([1.0, 2.0], margin=0.0, higher_is_better=True)


def test_paired_gaps_pair_by_seed():
    base = {0: 2.0, 1: 4.0, 2: 5.0}
    assert paired_gaps({0: 2.02, 1: 4.0, 3: 9.0}, base, relative=True) == pytest.approx({0: 1.0, 1: 0.0})
    assert paired_gaps({0: 1.5, 2: 5.5}, base, relative=False) == pytest.approx({0: -0.5, 2: 0.5})
