"""Paired comparisons over seeds: the gap of a run to the baseline of the same seed, and the verdict.

Two runs *pair* when they share a seed (same initialization, same data order) and differ only in the
recipe. The arithmetic, shared by ``infir2 demo`` and ``infir2 fidelity``:

* gap of a run: ``100 * (value - baseline value) / baseline value`` (%) for a loss (``gap_pct``), or
  ``value - baseline value`` in the metric's own unit (accuracy points);
* over seeds: the gaps' mean and sample standard deviation, ``None`` for one seed (``mean_sd``);
* the baseline's seed spread: ``100 * (max - min) / mean`` of its values over seeds (``spread_pct``),
  shown beside the gaps as how far two runs of the *same* recipe land apart;
* **the verdict** (``paired_verdict``): a two-sided 95% Student t-interval of the mean paired gap
  (``n - 1`` degrees of freedom; ``mean +- t * sd / sqrt(n)``), compared with an equivalence margin
  ``m`` stated per metric:

  - ``equivalent``: the whole interval lies inside ``[-m, +m]`` (checked first: a difference the
    seeds resolve but that is smaller than the margin does not matter);
  - ``worse`` / ``better``: the interval excludes 0, on the side where the metric gets worse /
    better (higher loss, lower accuracy is worse);
  - otherwise ``inconclusive: more seeds needed`` -- and always with fewer than two paired seeds,
    which have no interval;

* **the seeds a margin needs** (``seeds_needed``): the smallest ``n >= 2`` at which an interval
  around the measured mean with the measured sd, ``|mean| + t(n-1) * sd / sqrt(n)``, fits inside
  ``+-m`` -- what a run with too few seeds can say instead of a verdict (none when ``|mean| >= m``:
  no seed count shows equivalence then).

Pure functions of floats (no torch, no infir2 imports), so any layer may use them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

__all__ = [
    "CONFIDENCE",
    "EQUIVALENT",
    "INCONCLUSIVE",
    "Verdict",
    "gap_pct",
    "mean_sd",
    "paired_gaps",
    "paired_verdict",
    "seeds_needed",
    "spread_pct",
    "t_quantile",
]

CONFIDENCE = 0.95  # two-sided coverage of the interval
EQUIVALENT = "equivalent"
INCONCLUSIVE = "inconclusive: more seeds needed"


def gap_pct(value: float, base: float) -> float:
    """``value`` relative to ``base`` in % (positive: larger than the baseline)."""
    return 100 * (value - base) / base


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (``None`` for a single value; NaN for none)."""
    if not values:
        return math.nan, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def spread_pct(values: list[float]) -> float:
    """``100 * (max - min) / mean``: the relative range over seeds (0 for one value; NaN for none)."""
    return 100 * (max(values) - min(values)) / statistics.fmean(values) if values else math.nan


def _t_central(t: float, df: int) -> float:
    """``P(|T| < t)`` for Student's t with integer ``df`` (closed form, Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 0:  # sin(theta) * (1 + 1/2 c^2 + 1*3/(2*4) c^4 + ... up to c^(df-2))
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return s * total
    if df == 1:
        return 2 * theta / math.pi
    term, total = 1.0, 1.0  # (2/pi) (theta + sin cos (1 + 2/3 c^2 + 2*4/(3*5) c^4 + ... up to c^(df-3)))
    for k in range(1, (df - 1) // 2):
        term *= c2 * (2 * k) / (2 * k + 1)
        total += term
    return 2 / math.pi * (theta + s * math.cos(theta) * total)


def t_quantile(df: int, confidence: float = CONFIDENCE) -> float:
    """The ``t`` with ``P(|T| < t) = confidence`` for Student's t with ``df >= 1`` degrees of freedom."""
    if df < 1 or not 0 < confidence < 1:
        raise ValueError(f"t_quantile needs df >= 1 and 0 < confidence < 1, got df={df}, {confidence}")
    lo, hi = 0.0, 1.0
    while _t_central(hi, df) < confidence:
        hi *= 2
    for _ in range(200):  # bisection to float precision
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_central(mid, df) < confidence else (lo, mid)
    return (lo + hi) / 2


def paired_gaps(values: dict[int, float], base: dict[int, float], relative: bool) -> dict[int, float]:
    """Per seed both have: the gap in % of the baseline (``relative``) or as a plain difference."""
    return {
        s: gap_pct(values[s], base[s]) if relative else values[s] - base[s]
        for s in sorted(set(values) & set(base))
    }


@dataclass(frozen=True)
class Verdict:
    """The mean paired gap with its t-interval, and what it says against ``margin``."""

    gaps: tuple[float, ...]
    mean: float
    sd: float | None  # None: one paired seed
    low: float  # the interval (NaN with fewer than two gaps)
    high: float
    margin: float
    label: str  # EQUIVALENT, "worse", "better" or INCONCLUSIVE

    @property
    def n(self) -> int:
        return len(self.gaps)


def paired_verdict(gaps: list[float], margin: float, higher_is_better: bool) -> Verdict:
    """The rule of the module docstring for one metric's paired gaps (same unit as ``margin``)."""
    if margin <= 0:
        raise ValueError(f"the equivalence margin must be positive, got {margin}")
    mean, sd = mean_sd(list(gaps))
    if sd is None or not math.isfinite(mean):
        return Verdict(tuple(gaps), mean, sd, math.nan, math.nan, margin, INCONCLUSIVE)
    half = t_quantile(len(gaps) - 1) * sd / math.sqrt(len(gaps))
    low, high = mean - half, mean + half
    if -margin <= low and high <= margin:
        label = EQUIVALENT
    elif low > 0 or high < 0:
        label = "better" if (low > 0) == higher_is_better else "worse"
    else:
        label = INCONCLUSIVE
    return Verdict(tuple(gaps), mean, sd, low, high, margin, label)


def seeds_needed(mean: float, sd: float, margin: float, limit: int = 1000) -> int | None:
    """The smallest ``n >= 2`` with ``|mean| + t(n-1) * sd / sqrt(n) <= margin``: the paired seeds at
    which the measured gap (``mean``, ``sd``) would be judged equivalent. ``None`` when ``|mean| >=
    margin`` or the count passes ``limit`` (no number of seeds would do)."""
    if margin <= 0 or sd < 0:
        raise ValueError(f"seeds_needed needs margin > 0 and sd >= 0, got margin={margin}, sd={sd}")
    room = margin - abs(mean)
    if not room > 0:
        return None
    n = 2
    while t_quantile(n - 1) * sd / math.sqrt(n) > room:
        if n >= limit:
            return None
        # the half-width falls roughly as 1/sqrt(n): jump close to the answer, then step
        n = max(n + 1, min(limit, int((1.96 * sd / room) ** 2)))
    return n
