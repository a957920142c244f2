"""The demo's verdict, computed: is each FP8 recipe equivalent to the baseline, metric by metric?

For each FP8 recipe and each metric, the gap to the baseline run *of the same seed* (same
initialization, same data order), then over seeds its mean with a two-sided 95% Student t-interval,
compared with the metric's equivalence margin (``infir2.tools.paired.paired_verdict``, the rule ``infir2
fidelity`` uses too):

==================  ===========================================  ============  ======================
metric              gap                                          margin        worse when
==================  ===========================================  ============  ======================
CPT held-out loss   ``100 * (loss - base) / base`` (%)           +-2%          higher
SFT val loss        ``100 * (loss - base) / base`` (%)           +-10%         higher
accuracy            ``100 * (acc - base)`` (percentage points)   +-3 points    lower
==================  ===========================================  ============  ======================

Per metric: ``equivalent`` (the interval inside the margin), ``worse`` / ``better`` (the interval
excludes 0), else ``inconclusive: more seeds needed`` (always so with one paired seed); an unresolved
metric also says how many seeds its measured gap would need (``tools.paired.seeds_needed``).

**The headline** reads only the metrics a run of a few seeds can resolve: the accuracy here, and the
real-text held-out loss (``demo/text.py``). The two losses of the reasoning task are reported but kept
out of it: a tiny model trained to a near-deterministic task ends its CPT and SFT in a chaotic regime,
its baseline seeds land 5-20% (CPT) and 75-170% (SFT) apart, far beyond their +-2% / +-10% margins, so at
three seeds their intervals are tens to hundreds of % wide and only tell that more seeds would be
needed. A recipe's verdict, from its headline metrics: ``worse`` if any is, ``equivalent`` if every
one is, ``better`` if some are and the rest equivalent, else inconclusive (``combine``). The
baseline's own seed spread is shown beside the gaps, and the null control ``fp8_exact`` (the FP8 code
path with exact casts) is judged like any recipe: its gap is the noise floor that an FP8 recipe's gap
is read against.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ..paired import EQUIVALENT, INCONCLUSIVE, Verdict, paired_gaps, paired_verdict, seeds_needed, spread_pct
from ..recipe_spec import split_spec
from .results import RecipeResult

__all__ = [
    "METRICS",
    "NULL_CONTROL",
    "RECIPE_LABELS",
    "Metric",
    "MetricGap",
    "RecipeSummary",
    "combine",
    "format_gap",
    "format_spread",
    "needs_note",
    "recipe_label",
    "seed_spread",
    "short_label",
    "summarize",
    "verdict_sentence",
]

NULL_CONTROL = "fp8_exact"

RECIPE_LABELS = {
    "bf16": "baseline (no FP8; fp32 on CPU)",
    "blockwise": "FP8 blockwise (1x128 / 128x128, InfiR2)",
    "blockwise_fp32scale": "FP8 blockwise, fp32 scales",
    "rowwise": "FP8 rowwise",
    "tensorwise": "FP8 tensorwise (naive)",
    "blockwise_hybrid": "FP8 blockwise hybrid (E4M3, E5M2 gradients)",
    "nvfp4": "NVFP4 (E2M1, 1x16 / 16x16 blocks, emulated)",
    "nvfp4_4over6": "NVFP4 4-over-6 (emulated)",
    NULL_CONTROL: "null control (FP8 code path, exact casts)",
}


def recipe_label(spec: str) -> str:
    """The table label of a recipe spec (``infir2.tools.recipe_spec``): ``nvfp4+tail`` reads as
    NVFP4's label with its high-precision tail."""
    recipe, tail = split_spec(spec)
    label = RECIPE_LABELS.get(recipe, recipe)
    return f"{label.split(' (')[0]} + high-precision tail ({tail:.0%} of blocks)" if tail else label


def short_label(recipe: str) -> str:
    """``"FP8 blockwise"`` for ``blockwise``: the label without its parenthesis (for sentences)."""
    return recipe_label(recipe).split(" (")[0]


@dataclass(frozen=True)
class Metric:
    key: str  # a RecipeResult field
    label: str
    relative: bool  # True: a loss, gaps in % of the baseline; False: a fraction, gaps in percentage points
    margin: float  # the equivalence margin, in the unit of the gaps
    higher_is_better: bool
    headline: bool  # judged in the recipe's verdict; the others are reported beside it (module docstring)

    @property
    def margin_text(self) -> str:
        return f"+-{self.margin:g}%" if self.relative else f"+-{self.margin:g} points"


METRICS = (
    Metric("cpt_val_loss", "CPT held-out loss", True, 2.0, higher_is_better=False, headline=False),
    Metric("sft_val_loss", "SFT val loss", True, 10.0, higher_is_better=False, headline=False),
    Metric("accuracy", "accuracy", False, 3.0, higher_is_better=True, headline=True),
)


@dataclass(frozen=True)
class MetricGap:
    """One metric of one FP8 recipe against the baseline, over the seeds both ran."""

    metric: Metric
    seeds: tuple[int, ...]  # the paired seeds
    verdict: Verdict  # per-seed gaps (% for losses, points for accuracy), mean, t-interval, label
    base_values: tuple[float, ...]  # the baseline's values at all its seeds
    spread: float  # the baseline's seed spread, in the unit of the gaps

    @property
    def gaps(self) -> tuple[float, ...]:
        return self.verdict.gaps

    @property
    def mean(self) -> float:
        return self.verdict.mean

    @property
    def sd(self) -> float | None:
        return self.verdict.sd

    @property
    def seeds_needed(self) -> int | None:
        """The paired seeds at which this gap's mean and sd would be judged equivalent (None: none would)."""
        return None if self.sd is None else seeds_needed(self.mean, self.sd, self.metric.margin)


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
    verdict: str | None  # ``combine`` of the headline metrics' labels; None for the baseline


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
    scale = 1.0 if metric.relative else 100.0  # accuracy: fractions -> percentage points
    gaps = paired_gaps(
        {s: scale * v for s, v in mine.items()},
        {s: scale * v for s, v in base.items()},
        relative=metric.relative,
    )
    verdict = paired_verdict(list(gaps.values()), metric.margin, metric.higher_is_better)
    return MetricGap(metric, seeds, verdict, base_values, seed_spread(metric, list(base_values)))


def combine(labels: list[str]) -> str:
    """One verdict from the metrics' labels: any worse -> worse; all equivalent -> equivalent; some
    better and the rest equivalent -> better; otherwise inconclusive."""
    if "worse" in labels:
        return "worse"
    if labels and all(label == EQUIVALENT for label in labels):
        return EQUIVALENT
    if "better" in labels and all(label in (EQUIVALENT, "better") for label in labels):
        return "better"
    return INCONCLUSIVE


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
        seconds = statistics.fmean(r.seconds for r in mine)
        train = _mean([r.train_seconds for r in mine if r.train_seconds is not None])
        summaries.append(
            RecipeSummary(
                recipe=recipe,
                seeds=tuple(sorted(r.seed for r in mine)),
                means={m.key: _mean(list(_values(mine, m.key).values())) for m in METRICS},
                seconds=seconds,
                time_ratio=seconds / base_seconds if base_seconds > 0 else math.nan,
                train_ratio=train / base_train if train is not None and base_train else None,
                tokens_per_s=statistics.fmean(r.tokens_per_s for r in mine),
                gaps=tuple(gaps),
                verdict=combine([g.verdict.label for g in gaps if g.metric.headline]) if gaps else None,
            )
        )
    return summaries


def format_gap(gap: MetricGap) -> str:
    """``"+0.30% [-0.10, +0.70]"`` / ``"-2.0 points [-4.1, +0.1]"``: the mean gap and its 95% t-interval;
    ``"(1 seed)"`` in place of the interval."""
    v = gap.verdict
    digits, unit = (2, "%") if gap.metric.relative else (1, " points")
    if v.sd is None:
        return f"{v.mean:+.{digits}f}{unit} (1 seed)"
    return f"{v.mean:+.{digits}f}{unit} [{v.low:+.{digits}f}, {v.high:+.{digits}f}]"


def format_spread(metric: Metric, values: tuple[float, ...] | list[float]) -> str:
    """A recipe's noise over seeds in words: ``"seed spread 1.10%"`` (losses), ``"seeds 70-76%"`` (accuracy)."""
    if len(values) < 2:
        return "one seed"
    if metric.relative:
        return f"seed spread {seed_spread(metric, list(values)):.2f}%"
    return f"seeds {100 * min(values):.0f}-{100 * max(values):.0f}%"


def needs_note(label: str, sd: float | None, needed: int | None, margin_text: str) -> str:
    """What an unresolved gap (verdict ``label``, sd ``sd`` over seeds) would take, e.g. ``"~9 seeds would
    resolve +-3 points at the measured sd"``; empty when resolved or with no sd (one seed)."""
    if label != INCONCLUSIVE or sd is None:
        return ""
    if needed is None:
        return f"no seed count shows equivalence: the mean gap lies outside {margin_text}"
    return f"~{needed} seeds would resolve {margin_text} at the measured sd"


def _part(g: MetricGap, floor: MetricGap | None) -> str:
    notes = [f"null control {format_gap(floor)}"] if floor is not None else []
    notes.append(f"baseline {format_spread(g.metric, g.base_values)}")
    notes += (
        [note] if (note := needs_note(g.verdict.label, g.sd, g.seeds_needed, g.metric.margin_text)) else []
    )
    return f"{g.metric.label} {format_gap(g)} against {g.metric.margin_text}: {g.verdict.label} ({', '.join(notes)})"


def verdict_sentence(summary: RecipeSummary, null: RecipeSummary | None = None) -> str:
    """The generated verdict of one FP8 recipe on the reasoning task, e.g. ``"FP8 blockwise: equivalent
    to the baseline (...): accuracy -0.5 points [-1.9, +0.9] against +-3 points: equivalent (...).
    Reported, not judged at 3 seeds: CPT held-out loss ..."``; with ``null`` (the null control's
    summary) each metric also shows the null control's gap, the noise floor."""
    name = short_label(summary.recipe)
    if not summary.gaps:
        return f"{name}: no run pairs with the baseline at the same seed, so no gap to judge."
    floor = {g.metric.key: g for g in null.gaps} if null is not None and null is not summary else {}
    judged = [_part(g, floor.get(g.metric.key)) for g in summary.gaps if g.metric.headline]
    reported = [_part(g, floor.get(g.metric.key)) for g in summary.gaps if not g.metric.headline]
    n = max(g.verdict.n for g in summary.gaps)
    head = {
        EQUIVALENT: "equivalent to the baseline",
        "worse": "WORSE than the baseline",
        "better": "better than the baseline",
    }.get(summary.verdict or "", INCONCLUSIVE)
    text = (
        f"{name}: {head} (mean paired gap over {n} seed(s) with its 95% t-interval, against an "
        f"equivalence margin): " + "; ".join(judged) + "."
    )
    if reported:
        text += f" Reported, not judged at {n} seed(s): " + "; ".join(reported) + "."
    return text
