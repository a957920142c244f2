"""The fidelity benchmark's numbers: paired gaps, the baseline's seed spread, the table and the plot.

Everything here is a pure function of the per-run results (``RunResult``), so the arithmetic is
tested on planted runs without training anything:

* paired gap of an FP8 run: ``100 * (loss - baseline loss) / baseline loss`` (%), the baseline run of
  the same width *and seed* (same initialization, same data order);
* per (width, recipe): the gaps' mean and sample standard deviation over seeds (none with one seed);
* baseline seed spread per width: ``100 * (max - min) / mean`` of the baseline's losses over seeds
  (shown beside the gaps: how far two baseline runs land apart);
* the verdict per (width, recipe): the mean gap's two-sided 95% Student t-interval against an
  equivalence margin of ``MARGIN_PCT`` (+-1% held-out loss): ``equivalent`` (interval inside the
  margin), ``worse`` / ``better`` (interval excludes 0 above / below), else ``inconclusive: more seeds
  needed`` (always with one seed); shrinks with width: ``|mean gap|`` never grows from one width of
  the ladder to the next.

The per-seed arithmetic (gap, mean +- sd, spread, the verdict rule) is ``infir2.tools.paired``, which
``infir2 demo`` uses too.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..paired import EQUIVALENT, gap_pct, paired_verdict, spread_pct

__all__ = ["MARGIN_PCT", "RunResult", "plot", "save_figure", "summarize", "table", "write_outputs"]

_BASELINE = "bf16"
MARGIN_PCT = 1.0  # equivalence margin of the held-out loss gap, in % of the baseline


@dataclass(frozen=True)
class RunResult:
    """One trained model: its final held-out loss and how it got there."""

    width: int
    recipe: str
    seed: int
    val_loss: float  # final held-out loss (high-precision evaluation)
    train_loss: float  # last step's training loss
    tail_drop: float  # % the training loss still fell over the last fifth of the run
    steps: int
    seconds: float
    val_curve: tuple[
        tuple[int, float], ...
    ] = ()  # (step, held-out loss) of every evaluation, the last included


def summarize(runs: list[RunResult]) -> dict[str, Any]:
    """Baseline spread per width, paired gap per (width, FP8 recipe), and a verdict per recipe."""
    base = {(r.width, r.seed): r.val_loss for r in runs if r.recipe == _BASELINE}
    widths = sorted({r.width for r in runs})
    baseline: list[dict[str, Any]] = []
    for w in widths:
        losses = [base[k] for k in sorted(base) if k[0] == w]
        baseline.append(
            {
                "width": w,
                "losses": losses,
                "mean": statistics.fmean(losses) if losses else math.nan,
                "spread_pct": spread_pct(losses),
            }
        )
    spread_at = {b["width"]: b["spread_pct"] for b in baseline}
    gaps: list[dict[str, Any]] = []
    recipes = list(dict.fromkeys(r.recipe for r in runs if r.recipe != _BASELINE))
    for recipe in recipes:
        for w in widths:
            paired = sorted(
                (r.seed, gap_pct(r.val_loss, base[(w, r.seed)]))
                for r in runs
                if r.recipe == recipe and r.width == w and (w, r.seed) in base
            )
            if not paired:
                continue
            values = [g for _, g in paired]
            v = paired_verdict(values, MARGIN_PCT, higher_is_better=False)
            gaps.append(
                {
                    "width": w,
                    "recipe": recipe,
                    "seeds": [s for s, _ in paired],
                    "gaps_pct": values,
                    "mean_pct": v.mean,
                    "sd_pct": v.sd,
                    "low_pct": _finite(v.low),
                    "high_pct": _finite(v.high),
                    "margin_pct": MARGIN_PCT,
                    "verdict": v.label,
                    "spread_pct": spread_at[w],
                }
            )
    verdict: dict[str, dict[str, bool | None]] = {}
    for recipe in recipes:
        rows = [g for g in gaps if g["recipe"] == recipe]
        sizes = [abs(g["mean_pct"]) for g in rows]
        verdict[recipe] = {
            "equivalent_at_every_width": all(g["verdict"] == EQUIVALENT for g in rows),
            # None: a single width says nothing about the trend
            "shrinks_with_width": all(b <= a for a, b in itertools.pairwise(sizes))
            if len(sizes) > 1
            else None,
        }
    return {"baseline": baseline, "gaps": gaps, "verdict": verdict}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no NaN


def _gap(g: dict[str, Any] | None) -> str:
    if g is None:
        return "(baseline)"
    if g["low_pct"] is None:
        return f"{g['mean_pct']:+.2f} (1 seed)"
    return f"{g['mean_pct']:+.2f} [{g['low_pct']:+.2f}, {g['high_pct']:+.2f}]"


def _yes(flag: bool | None) -> str:
    return "n/a (one width)" if flag is None else "yes" if flag else "no"


def table(summary: dict[str, Any], runs: list[dict[str, Any]] | list[RunResult]) -> str:
    """Markdown: one row per (width, recipe): losses by seed, paired gap, baseline spread, verdict."""
    rows = [r if isinstance(r, RunResult) else RunResult(**r) for r in runs]
    spread = {b["width"]: b["spread_pct"] for b in summary["baseline"]}
    gap = {(g["width"], g["recipe"]): g for g in summary["gaps"]}
    head = [
        "width",
        "recipe",
        "held-out loss by seed",
        "paired gap % (mean, 95% t-interval)",
        "baseline seed spread %",
        f"verdict (margin +-{MARGIN_PCT:g}%)",
        "tail drop %",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in sorted(spread):
        for recipe in dict.fromkeys(r.recipe for r in rows):
            mine = sorted((r for r in rows if r.width == w and r.recipe == recipe), key=lambda r: r.seed)
            if not mine:
                continue
            losses = " / ".join(f"{r.val_loss:.4f}" for r in mine)
            drops = " / ".join(f"{r.tail_drop:.1f}" for r in mine)
            g = gap.get((w, recipe))
            cells = [str(w), recipe, losses, _gap(g), f"{spread[w]:.2f}", g["verdict"] if g else "", drops]
            lines.append("| " + " | ".join(cells) + " |")
    verdict = [
        f"- {recipe}: equivalent to the baseline (+-{MARGIN_PCT:g}%) at every width: "
        f"{_yes(v['equivalent_at_every_width'])}; |gap| shrinks with width: "
        f"{_yes(v['shrinks_with_width'])}"
        for recipe, v in summary["verdict"].items()
    ]
    return "\n".join([*lines, "", *verdict])


def plot(summary: dict[str, Any], path: Path) -> None:
    """Paired gap vs width, one line per FP8 recipe (error bars: 95% t-interval), margin and spread shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    widths = [b["width"] for b in summary["baseline"]]
    spreads = [b["spread_pct"] for b in summary["baseline"]]
    ax.fill_between(widths, [-s for s in spreads], spreads, color="0.85", label="baseline seed spread (+-)")
    ax.axhspan(
        -MARGIN_PCT, MARGIN_PCT, color="tab:green", alpha=0.08, label=f"equivalence margin +-{MARGIN_PCT:g}%"
    )
    for recipe in dict.fromkeys(g["recipe"] for g in summary["gaps"]):
        rows = [g for g in summary["gaps"] if g["recipe"] == recipe]
        low = [g["mean_pct"] - g["low_pct"] if g["low_pct"] is not None else 0.0 for g in rows]
        high = [g["high_pct"] - g["mean_pct"] if g["high_pct"] is not None else 0.0 for g in rows]
        ax.errorbar(
            [g["width"] for g in rows],
            [g["mean_pct"] for g in rows],
            yerr=[low, high],
            marker="o",
            capsize=3,
            label=f"{recipe} (95% t-interval)",
        )
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_xlabel("hidden size")
    ax.set_ylabel("held-out loss gap to baseline, same seed (%)")
    ax.set_title("FP8 fidelity on the King James Bible")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> None:
    """Write a matplotlib figure as a 110-dpi PNG (tight layout) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out: Path, result: dict[str, Any]) -> None:
    """``fidelity.json``, ``fidelity.md`` (the table) and ``fidelity_gap.png`` in ``out``."""
    (out / "fidelity.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "fidelity.md").write_text(table(result["summary"], result["runs"]) + "\n")
    plot(result["summary"], out / "fidelity_gap.png")
