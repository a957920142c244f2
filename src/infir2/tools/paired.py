"""Paired comparisons over seeds: is an FP8 run's gap to the baseline larger than the baseline's own noise?

Two runs *pair* when they share a seed (same initialization, same data order) and differ only in the
recipe. The arithmetic, shared by ``infir2 demo`` and ``infir2 fidelity``:

* gap of a run: ``100 * (value - baseline value) / baseline value`` (%), against the baseline run of
  the same seed (``gap_pct``);
* over seeds: the gaps' mean and sample standard deviation, ``None`` for one seed (``mean_sd``);
* the baseline's seed spread: ``100 * (max - min) / mean`` of its values over seeds (``spread_pct``):
  how far two runs of the *same* recipe land apart when only the seed changes;
* within noise: ``|mean gap| <= seed spread`` (``within_noise``). A gap the baseline itself shows
  between seeds is no evidence that FP8 changed anything.

Pure functions of floats (no torch, no infir2 imports), so any layer may use them.
"""

from __future__ import annotations

import math
import statistics

__all__ = ["gap_pct", "mean_sd", "spread_pct", "within_noise"]


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


def within_noise(mean_gap: float, spread: float) -> bool:
    """The rule: a mean gap no larger in size than the baseline's seed spread (NaN is never within)."""
    return abs(mean_gap) <= spread
