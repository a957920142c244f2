"""The demo's verdict, computed: is each FP8 recipe within the baseline's seed-to-seed noise?

For each FP8 recipe and each metric, the gap to the baseline run *of the same seed* (same
initialization, same data order), then over seeds its mean +- sample sd, next to the baseline's own
seed spread (``infir2.tools.paired``, the arithmetic ``infir2 fidelity`` uses too):

==================  ===========================================  ======================================
metric              gap                                          baseline seed spread
==================  ===========================================  ======================================
CPT held-out loss   ``100 * (loss - base) / base`` (%)           ``100 * (max - min) / mean`` (%)
SFT val loss        ``100 * (loss - base) / base`` (%)           ``100 * (max - min) / mean`` (%)
accuracy            ``100 * (acc - base)`` (percentage points)   ``100 * (max - min)`` (points)
==================  ===========================================  ======================================

A metric is within noise iff ``|mean gap| <= spread``; a recipe is within noise iff every metric is.
With one seed there is no spread to judge against: the verdict is ``None`` and the sentence says so.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ..paired import gap_pct, mean_sd, spread_pct, within_noise
from .results import RecipeResult

__all__ = [
    "METRICS",
    "RECIPE_LABELS",
    "Metric",
    "MetricGap",
    "RecipeSummary",
    "format_gap",
    "format_spread",
    "seed_spread",
    "short_label",
    "summarize",
    "verdict_sentence",
]

RECIPE_LABELS = {
    "bf16": "baseline (no FP8; fp32 on CPU)",
    "blockwise": "FP8 blockwise (1x128 / 128x128, InfiR2)",
    "blockwise_fp32scale": "FP8 blockwise, fp32 scales",
    "rowwise": "FP8 rowwise",
    "tensorwise": "FP8 tensorwise (naive)",
}


def short_label(recipe: str) -> str:
    """``"FP8 blockwise"`` for ``blockwise``: the label without its parenthesis (for sentences)."""
    return RECIPE_LABELS.get(recipe, recipe).split(" (")[0]


@dataclass(frozen=True)
class Metric:
    key: str  # a RecipeResult field
    label: str
    relative: bool  # True: a loss, gaps in % of the baseline; False: a fraction, gaps in percentage points


METRICS = (
    Metric("cpt_val_loss", "CPT held-out loss", relative=True),
    Metric("sft_val_loss", "SFT val loss", relative=True),
    Metric("accuracy", "accuracy", relative=False),
)


@dataclass(frozen=True)
class MetricGap:
    """One metric of one FP8 recipe against the baseline, over the seeds both ran."""

    metric: Metric
    seeds: tuple[int, ...]  # the paired seeds
    gaps: tuple[float, ...]  # per paired seed: % (losses) or points (accuracy)
    mean: float
    sd: float | None  # None: one paired seed
    base_values: tuple[float, ...]  # the baseline's values at all its seeds
    spread: float  # the baseline's seed spread, in the unit of the gaps
    within_noise: bool | None  # None: fewer than two baseline seeds, so no spread to judge against


@dataclass(frozen=True)
class RecipeSummary:
    """One recipe over its seeds: means, speed relative to the baseline, and (FP8) gaps and verdict."""

    recipe: str
    seeds: tuple[int, ...]
    means: dict[str, float | None]  # metric key -> mean over seeds (None when no seed has it)
    seconds: float  # mean wall clock of one run (CPT + SFT + evaluation)
    time_ratio: float  # seconds / the baseline's seconds
    train_ratio: float | None  # the same for the optimizer steps alone (None: not recorded)
    tokens_per_s: float  # mean over seeds
    gaps: tuple[MetricGap, ...]  # empty for the baseline
    within_noise: bool | None  # every metric within noise; None for the baseline or with one seed


def _values(runs: list[RecipeResult], key: str) -> dict[int, float]:
    return {r.seed: float(v) for r in runs if (v := getattr(r, key)) is not None}


def seed_spread(metric: Metric, values: list[float]) -> float:
    """The spread of one recipe's values over seeds: % of the mean (losses), points (accuracy)."""
    return spread_pct(values) if metric.relative else 100 * (max(values) - min(values))


def _metric_gap(metric: Metric, mine: dict[int, float], base: dict[int, float]) -> MetricGap | None:
    seeds = tuple(sorted(set(mine) & set(base)))
    if not seeds:
        return None
    base_values = tuple(base[s] for s in sorted(base))
    if metric.relative:
        gaps = tuple(gap_pct(mine[s], base[s]) for s in seeds)
    else:
        gaps = tuple(100 * (mine[s] - base[s]) for s in seeds)
    mean, sd = mean_sd(list(gaps))
    spread = seed_spread(metric, list(base_values))
    judged = within_noise(mean, spread) if len(base_values) > 1 else None
    return MetricGap(metric, seeds, gaps, mean, sd, base_values, spread, judged)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(runs: list[RecipeResult], recipes: list[str]) -> list[RecipeSummary]:
    """One summary per recipe, in ``recipes`` order; ``recipes[0]`` is the baseline."""
    by_recipe = {recipe: [r for r in runs if r.recipe == recipe] for recipe in recipes}
    missing = [recipe for recipe, mine in by_recipe.items() if not mine]
    if missing:
        raise ValueError(f"no runs of recipe(s) {missing} among the results")
    base_runs = by_recipe[recipes[0]]
    base_seconds = statistics.fmean(r.seconds for r in base_runs)
    base_train = _mean([r.train_seconds for r in base_runs if r.train_seconds is not None])
    summaries = []
    for recipe, mine in by_recipe.items():
        gaps: list[MetricGap] = []
        if recipe != recipes[0]:
            for metric in METRICS:
                gap = _metric_gap(metric, _values(mine, metric.key), _values(base_runs, metric.key))
                if gap is not None:
                    gaps.append(gap)
        judged = [g.within_noise for g in gaps]
        seconds = statistics.fmean(r.seconds for r in mine)
        train = _mean([r.train_seconds for r in mine if r.train_seconds is not None])
        summaries.append(RecipeSummary(
            recipe=recipe,
            seeds=tuple(sorted(r.seed for r in mine)),
            means={m.key: _mean(list(_values(mine, m.key).values())) for m in METRICS},
            seconds=seconds,
            time_ratio=seconds / base_seconds if base_seconds > 0 else math.nan,
            train_ratio=train / base_train if train is not None and base_train else None,
            tokens_per_s=statistics.fmean(r.tokens_per_s for r in mine),
            gaps=tuple(gaps),
            within_noise=None if not judged or None in judged else all(judged),
        ))  # fmt: skip
    return summaries


def format_gap(gap: MetricGap) -> str:
    """``"+0.30 +- 0.20%"`` / ``"-2.0 +- 3.0 points"``; ``"(1 seed)"`` in place of the sd."""
    digits, unit = (2, "%") if gap.metric.relative else (1, " points")
    if gap.sd is None:
        return f"{gap.mean:+.{digits}f}{unit} (1 seed)"
    return f"{gap.mean:+.{digits}f} +- {gap.sd:.{digits}f}{unit}"


def format_spread(metric: Metric, values: tuple[float, ...] | list[float]) -> str:
    """A recipe's noise over seeds in words: ``"seed spread 1.10%"`` (losses), ``"seeds 70-76%"`` (accuracy)."""
    if len(values) < 2:
        return "one seed"
    if metric.relative:
        return f"seed spread {seed_spread(metric, list(values)):.2f}%"
    return f"seeds {100 * min(values):.0f}-{100 * max(values):.0f}%"


def verdict_sentence(summary: RecipeSummary) -> str:
    """The generated verdict of one FP8 recipe, e.g. ``"FP8 blockwise is within noise of the baseline:
    CPT held-out loss +0.30 +- 0.20% (baseline seed spread 1.10%), ..."``."""
    parts = ", ".join(
        f"{g.metric.label} {format_gap(g)} (baseline {format_spread(g.metric, g.base_values)})"
        for g in summary.gaps
    )
    name = short_label(summary.recipe)
    if not summary.gaps:
        return f"{name}: no run pairs with the baseline at the same seed, so no gap to judge."
    if summary.within_noise is None:
        return (f"{name} cannot be judged against noise: the baseline ran one seed, so it has no seed "
                f"spread (run two or more with --seeds): {parts}.")  # fmt: skip
    if summary.within_noise:
        return f"{name} is within noise of the baseline: {parts}."
    outside = ", ".join(g.metric.label for g in summary.gaps if not g.within_noise)
    return (
        f"{name} is NOT within noise of the baseline ({outside} beyond the baseline's seed spread): {parts}."
    )
