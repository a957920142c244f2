"""The demo's figures, drawn from ``results.json`` alone (``DemoRecord``) like the report.

* ``verdict.png`` (``verdict_figure``): the verdict at a glance. One panel per headline metric -- the
  real-text held-out loss gap (%) and the reasoning task's accuracy gap (points) -- with, per FP8
  recipe, the paired gap of every seed (dots), their mean with its 95% t-interval (the bar), the
  equivalence margin (the shaded band) and the verdict; the null control ``fp8_exact`` stands beside
  the FP8 recipes in grey, the noise floor. Then the real-text held-out loss over the steps of every
  run (a colour per recipe, a line style per seed).
* ``loss_curves.png`` (``loss_curves_figure``): the reasoning task's CPT and SFT training loss of every
  run, on a log axis (the CPT loss falls from ~6 to ~0.5 in its first hundred steps, then keeps
  falling slowly: a linear axis shows that tail as a flat line).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bench.fidelity_report import save_figure
from .results import DemoRecord
from .summary import METRICS, NULL_CONTROL, short_label, summarize

__all__ = [
    "GapBar",
    "loss_curves_figure",
    "plot_loss_curves",
    "plot_verdict",
    "verdict_bars",
    "verdict_figure",
]

_BASELINE_COLOUR = "black"
_NULL_COLOUR = "tab:gray"
_FP8_COLOURS = ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange")
_SEED_STYLES = ("-", "--", ":", "-.")
_BAND_COLOUR = "tab:green"
_CLIP = 5  # a gap panel's axis reaches at most this many margins; beyond, values are written at its edge


@dataclass(frozen=True)
class GapBar:
    """One recipe's paired gaps on one metric, as drawn: seeds' gaps, mean, interval, verdict."""

    recipe: str
    gaps: tuple[float, ...]
    mean: float
    low: float | None  # None: one seed, no interval
    high: float | None
    verdict: str


def verdict_bars(record: DemoRecord) -> dict[str, tuple[float, str, list[GapBar]]]:
    """Per headline panel title: (margin, unit, one ``GapBar`` per FP8 recipe in ``record.recipes``
    order). The real-text panel is absent when that part did not run."""
    panels: dict[str, tuple[float, str, list[GapBar]]] = {}
    if record.text is not None:
        text_gaps = record.text["summary"]["gaps"]
        bars = [
            GapBar(
                g["recipe"], tuple(g["gaps_pct"]), g["mean_pct"], g["low_pct"], g["high_pct"], g["verdict"]
            )
            for g in text_gaps
        ]
        margin = text_gaps[0]["margin_pct"] if text_gaps else 1.0
        panels["real text: held-out loss gap"] = (margin, "%", bars)
    summaries = summarize(record.runs, record.recipes)
    for metric in (m for m in METRICS if m.headline):
        bars = []
        for s in summaries[1:]:
            for g in (g for g in s.gaps if g.metric is metric):
                v = g.verdict
                low, high = (None, None) if v.sd is None else (v.low, v.high)
                bars.append(GapBar(s.recipe, v.gaps, v.mean, low, high, v.label))
        unit = "%" if metric.relative else "points"
        panels[f"reasoning task: {metric.label} gap"] = (metric.margin, unit, bars)
    return panels


def _colour(recipe: str, recipes: list[str]) -> str:
    if recipe == NULL_CONTROL:
        return _NULL_COLOUR
    if recipe == recipes[0]:
        return _BASELINE_COLOUR
    fp8 = [r for r in recipes[1:] if r != NULL_CONTROL]
    return _FP8_COLOURS[fp8.index(recipe) % len(_FP8_COLOURS)] if recipe in fp8 else _FP8_COLOURS[0]


def _gap_panel(ax: Any, title: str, margin: float, unit: str, bars: list[GapBar], recipes: list[str]) -> None:
    ax.axhspan(
        -margin, margin, color=_BAND_COLOUR, alpha=0.15, label=f"equivalence margin +-{margin:g} {unit}"
    )
    ax.axhline(0.0, color="black", linewidth=0.8)
    for i, bar in enumerate(bars):
        colour = _colour(bar.recipe, recipes)
        ax.scatter([i + 0.12] * len(bar.gaps), bar.gaps, s=14, color=colour, alpha=0.5, zorder=3)
        error = None if bar.low is None or bar.high is None else [[bar.mean - bar.low], [bar.high - bar.mean]]
        drawn = ax.errorbar(
            [i], [bar.mean], yerr=error, fmt="o", color=colour, capsize=6, linewidth=2, zorder=4
        )
        drawn.lines[0].set_gid("mean")  # the marker at the mean gap (tests find it by this id)
    labels = [
        f"{short_label(b.recipe)}\n{len(b.gaps)} seed(s)\n" + b.verdict.replace(": ", ":\n") for b in bars
    ]
    ax.set_xticks(range(len(bars)), labels, fontsize=8)
    ax.set_xlim(-0.6, max(len(bars), 1) - 0.4)
    values = [v for b in bars for v in (*b.gaps, b.low or 0.0, b.high or 0.0)]
    reach = min(max([margin, *map(abs, values)]), _CLIP * margin)  # a failed run must not hide the band
    limit = 1.35 * reach
    ax.set_ylim(-limit, limit)
    for i, bar in enumerate(bars):  # what lies beyond the axis: its value, written at the edge
        for x, v in [(i + 0.12, g) for g in bar.gaps] + [(i - 0.12, bar.mean), (i, bar.low), (i, bar.high)]:
            if v is not None and abs(v) > limit:
                y = limit if v > 0 else -limit
                ax.annotate(f"{v:+.0f}", (x, y), fontsize=7, ha="center", va="top" if v > 0 else "bottom")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(f"FP8 - baseline, same seed ({unit})")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    if not bars:
        ax.text(0.5, 0.5, "no paired runs", transform=ax.transAxes, ha="center")
    elif NULL_CONTROL in recipes and all(b.recipe != NULL_CONTROL for b in bars):
        ax.text(
            0.02, 0.02, "null control: not run here", transform=ax.transAxes, fontsize=7, color=_NULL_COLOUR
        )


def _plain_log_ticks(ax: Any) -> None:
    """A log y axis labelled with plain numbers (5.2, not 5.2 x 10^0)."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    low, high = ax.get_ylim()
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    if high < 10 * low:  # within one decade: every minor tick labelled
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
    elif high < 1000 * low:  # up to three decades: 2 and 5 of each decade labelled
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())


def _text_curves(ax: Any, record: DemoRecord) -> None:
    runs = record.text["runs"] if record.text is not None else []
    seeds = sorted({r["seed"] for r in runs})
    drawn = 0
    for r in runs:
        curve = r.get("val_curve") or []
        if not curve:
            continue
        ax.plot(
            [c[0] for c in curve],
            [c[1] for c in curve],
            color=_colour(r["recipe"], record.recipes),
            linestyle=_SEED_STYLES[seeds.index(r["seed"]) % len(_SEED_STYLES)],
            marker=".",
            linewidth=1,
            label=f"{short_label(r['recipe'])}, seed {r['seed']}",
        )
        drawn += 1
    ax.set_title("real text: held-out loss by step", fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out loss (per token, fp32; log scale)")
    ax.set_yscale("log")
    _plain_log_ticks(ax)
    ax.grid(alpha=0.3, which="both")
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no held-out curve recorded", transform=ax.transAxes, ha="center")


def verdict_figure(record: DemoRecord) -> Any:
    """The verdict figure (a matplotlib ``Figure``): a gap panel per headline metric, then the curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = verdict_bars(record)
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 4.8))
    for ax, (title, (margin, unit, bars)) in zip(axes, panels.items(), strict=False):
        _gap_panel(ax, title, margin, unit, bars, record.recipes)
    _text_curves(axes[-1], record)
    seeds = ", ".join(str(s) for s in sorted({r.seed for r in record.runs}))
    fig.suptitle(
        f"FP8 vs the baseline, paired by seed (seeds {seeds}): mean gap and 95% t-interval", fontsize=11
    )
    return fig


def plot_verdict(record: DemoRecord, path: Path) -> None:
    save_figure(verdict_figure(record), path)


def loss_curves_figure(record: DemoRecord) -> Any:
    """CPT and SFT training loss of every run, log y: a colour per recipe, a line style per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({r.seed for r in record.runs})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, stage in zip(axes, ("cpt", "sft"), strict=True):
        for r in record.runs:
            curve = getattr(r, f"{stage}_curve")
            ax.plot(
                [c[0] for c in curve],
                [c[1] for c in curve],
                color=_colour(r.recipe, record.recipes),
                linestyle=_SEED_STYLES[seeds.index(r.seed) % len(_SEED_STYLES)],
                linewidth=1,
                label=f"{short_label(r.recipe)}, seed {r.seed}",
            )
        ax.set_title(f"reasoning task: {stage.upper()} training loss")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (per token, log scale)")
        ax.set_yscale("log")
        _plain_log_ticks(ax)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return fig


def plot_loss_curves(record: DemoRecord, path: Path) -> None:
    save_figure(loss_curves_figure(record), path)
