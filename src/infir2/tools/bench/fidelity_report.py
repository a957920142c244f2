"""The fidelity benchmark's numbers: paired gaps, the baseline's seed spread, the table and the plot.

Everything here is a pure function of the per-run results (``RunResult``), so the arithmetic is
tested on planted runs without training anything:

* paired gap of an FP8 run: ``100 * (loss - baseline loss) / baseline loss`` (%), the baseline run of
  the same width *and seed* (same initialization, same data order);
* per (width, recipe): the gaps' mean and sample standard deviation over seeds (none with one seed);
* baseline seed spread per width: ``100 * (max - min) / mean`` of the baseline's losses over seeds;
* within noise: ``|mean gap| <= seed spread``; shrinks with width: ``|mean gap|`` never grows from one
  width of the ladder to the next.

The per-seed arithmetic (gap, mean +- sd, spread, the within-noise rule) is ``infir2.tools.paired``, which
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

from ..paired import gap_pct, mean_sd, spread_pct, within_noise

__all__ = ["RunResult", "plot", "summarize", "table", "write_outputs"]

_BASELINE = "bf16"


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


def summarize(runs: list[RunResult]) -> dict[str, Any]:
    """Baseline spread per width, paired gap per (width, FP8 recipe), and a verdict per recipe."""
    base = {(r.width, r.seed): r.val_loss for r in runs if r.recipe == _BASELINE}
    widths = sorted({r.width for r in runs})
    baseline: list[dict[str, Any]] = []
    for w in widths:
        losses = [base[k] for k in sorted(base) if k[0] == w]
        baseline.append({"width": w, "losses": losses, "mean": statistics.fmean(losses) if losses else math.nan,
                         "spread_pct": spread_pct(losses)})  # fmt: skip
    spread_at = {b["width"]: b["spread_pct"] for b in baseline}
    gaps: list[dict[str, Any]] = []
    recipes = list(dict.fromkeys(r.recipe for r in runs if r.recipe != _BASELINE))
    for recipe in recipes:
        for w in widths:
            paired = sorted((r.seed, gap_pct(r.val_loss, base[(w, r.seed)])) for r in runs
                            if r.recipe == recipe and r.width == w and (w, r.seed) in base)  # fmt: skip
            if not paired:
                continue
            values = [g for _, g in paired]
            mean, sd = mean_sd(values)
            gaps.append({"width": w, "recipe": recipe, "seeds": [s for s, _ in paired], "gaps_pct": values,
                         "mean_pct": mean, "sd_pct": sd, "within_noise": within_noise(mean, spread_at[w])})  # fmt: skip
    verdict: dict[str, dict[str, bool | None]] = {}
    for recipe in recipes:
        rows = [g for g in gaps if g["recipe"] == recipe]
        sizes = [abs(g["mean_pct"]) for g in rows]
        verdict[recipe] = {
            "within_noise_at_every_width": all(g["within_noise"] for g in rows),
            # None: a single width says nothing about the trend
            "shrinks_with_width": all(b <= a for a, b in itertools.pairwise(sizes))
            if len(sizes) > 1
            else None,
        }
    return {"baseline": baseline, "gaps": gaps, "verdict": verdict}


def _gap(g: dict[str, Any] | None) -> str:
    if g is None:
        return "(baseline)"
    return (
        f"{g['mean_pct']:+.2f} (1 seed)"
        if g["sd_pct"] is None
        else f"{g['mean_pct']:+.2f} +- {g['sd_pct']:.2f}"
    )


def _yes(flag: bool | None) -> str:
    return "n/a (one width)" if flag is None else "yes" if flag else "no"


def table(summary: dict[str, Any], runs: list[dict[str, Any]] | list[RunResult]) -> str:
    """Markdown: one row per (width, recipe): losses by seed, paired gap, baseline spread, verdict."""
    rows = [r if isinstance(r, RunResult) else RunResult(**r) for r in runs]
    spread = {b["width"]: b["spread_pct"] for b in summary["baseline"]}
    gap = {(g["width"], g["recipe"]): g for g in summary["gaps"]}
    head = ["width", "recipe", "held-out loss by seed", "paired gap % (mean +- sd)", "baseline seed spread %",
            "within noise", "tail drop %"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in sorted(spread):
        for recipe in dict.fromkeys(r.recipe for r in rows):
            mine = sorted((r for r in rows if r.width == w and r.recipe == recipe), key=lambda r: r.seed)
            if not mine:
                continue
            losses = " / ".join(f"{r.val_loss:.4f}" for r in mine)
            drops = " / ".join(f"{r.tail_drop:.1f}" for r in mine)
            g = gap.get((w, recipe))
            cells = [str(w), recipe, losses, _gap(g),
                     f"{spread[w]:.2f}", ("yes" if g["within_noise"] else "NO") if g else "", drops]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    verdict = [f"- {recipe}: within the baseline's seed spread at every width: "
               f"{_yes(v['within_noise_at_every_width'])}; |gap| shrinks with width: "
               f"{_yes(v['shrinks_with_width'])}" for recipe, v in summary["verdict"].items()]  # fmt: skip
    return "\n".join([*lines, "", *verdict])


def plot(summary: dict[str, Any], path: Path) -> None:
    """Paired gap vs width, one line per FP8 recipe (error bars: sd over seeds), seed spread shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    widths = [b["width"] for b in summary["baseline"]]
    spreads = [b["spread_pct"] for b in summary["baseline"]]
    ax.fill_between(widths, [-s for s in spreads], spreads, color="0.85", label="baseline seed spread (+-)")
    for recipe in dict.fromkeys(g["recipe"] for g in summary["gaps"]):
        rows = [g for g in summary["gaps"] if g["recipe"] == recipe]
        ax.errorbar([g["width"] for g in rows], [g["mean_pct"] for g in rows], yerr=[g["sd_pct"] or 0.0 for g in rows],
                    marker="o", capsize=3, label=recipe)  # fmt: skip
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_xlabel("hidden size")
    ax.set_ylabel("held-out loss gap to baseline, same seed (%)")
    ax.set_title("FP8 fidelity on the King James Bible")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out: Path, result: dict[str, Any]) -> None:
    """``fidelity.json``, ``fidelity.md`` (the table) and ``fidelity_gap.png`` in ``out``."""
    (out / "fidelity.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "fidelity.md").write_text(table(result["summary"], result["runs"]) + "\n")
    plot(result["summary"], out / "fidelity_gap.png")
