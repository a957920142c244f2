"""The demo's report, rendered from ``results.json`` alone: ``report.md``, ``readme_table.md``,
``verdict.png`` and ``loss_curves.png`` (``figure.py``) in the output folder, and the README's demo table.

* ``headline(record)``: the verdict per FP8 recipe from the headline metrics (the real-text held-out
  loss and the reasoning task's accuracy; ``summary.py`` says why the other two are left out), each
  with its interval and, unresolved, the seeds its measured gap would need.
* ``readme_table(record)``: the headline, then the README-ready table -- per recipe the means over
  seeds, each FP8 gap to the baseline as the mean over paired seeds with its 95% t-interval (the
  baseline's row shows its own seed spread), speed relative to the baseline -- and the generated
  verdict sentences (``summary.py``).
* ``report(record)``: that table, plus the model and schedule, and every (recipe, seed) run.
* ``update_readme(readme, record)``: replaces the block between ``README_START`` and ``README_END`` in a
  README with ``readme_table(record)``; nothing else in the file changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .figure import plot_loss_curves, plot_verdict
from .results import DemoRecord, RecipeResult
from .summary import (
    METRICS,
    NULL_CONTROL,
    RecipeSummary,
    combine,
    format_gap,
    format_spread,
    needs_note,
    recipe_label,
    short_label,
    summarize,
    verdict_sentence,
)
from .text import text_needs, text_section

__all__ = ["README_END", "README_START", "headline", "readme_table", "render", "report", "update_readme"]

README_START = "<!-- demo-table:start -->"
README_END = "<!-- demo-table:end -->"


def _num(value: float | None, digits: int = 4) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _gap_cells(s: RecipeSummary, base: RecipeSummary, runs: list[RecipeResult]) -> list[str]:
    """The gap cells of a row, one per metric: FP8 gaps (mean [t-interval]), or the baseline's own seed spread."""
    if s is not base:
        by_key = {g.metric.key: format_gap(g) for g in s.gaps}
        return [by_key.get(m.key, "—") for m in METRICS]
    values = {
        m.key: [v for r in runs if r.recipe == s.recipe and (v := getattr(r, m.key)) is not None]
        for m in METRICS
    }
    return [format_spread(m, values[m.key]) if values[m.key] else "—" for m in METRICS]


def _text_part(gap: dict[str, Any] | None) -> tuple[str, str | None]:
    """The real-text clause of a recipe's headline, and its verdict label (None: not run)."""
    if gap is None:
        return "real-text held-out loss: not run for this recipe", None
    size = f"{gap['mean_pct']:+.2f}%" + (
        f" [{gap['low_pct']:+.2f}, {gap['high_pct']:+.2f}]" if gap["low_pct"] is not None else " (1 seed)"
    )
    note = text_needs(gap)
    return (
        f"real-text held-out loss {size} against +-{gap['margin_pct']:g}%: {gap['verdict']}"
        + (f" ({note})" if note else ""),
        gap["verdict"],
    )


def _left_out(summaries: list[RecipeSummary]) -> str:
    """The sentence on the metrics kept out of the headline, with what they would need (first FP8 recipe)."""
    gaps = [g for g in summaries[1].gaps if not g.metric.headline] if len(summaries) > 1 else []
    if not gaps:
        return ""
    parts = [
        f"{g.metric.label} (baseline {format_spread(g.metric, g.base_values)} against {g.metric.margin_text}; "
        + (needs_note(g.verdict.label, g.sd, g.seeds_needed, g.metric.margin_text) or g.verdict.label)
        + ")"
        for g in gaps
    ]
    return (
        f"Not in the headline, reported below: the reasoning task's {' and '.join(g.metric.label for g in gaps)}, "
        f"whose seed-to-seed noise a few seeds cannot resolve -- for {short_label(summaries[1].recipe)}: "
        + "; ".join(parts)
        + "."
    )


def headline(record: DemoRecord) -> list[str]:
    """Markdown lines: per FP8 recipe, the verdict of the headline metrics (real text, accuracy)."""
    summaries = summarize(record.runs, record.recipes)
    text_gaps = {g["recipe"]: g for g in record.text["summary"]["gaps"]} if record.text else {}
    seeds = ", ".join(str(s) for s in sorted({r.seed for r in record.runs}))
    lines = [
        f"**The verdict (seeds {seeds}): the real-text held-out loss and the reasoning task's accuracy.**",
        "",
    ]
    for s in summaries[1:]:
        text, text_label = _text_part(text_gaps.get(s.recipe))
        parts, labels = [text], [text_label] if text_label is not None else []
        for g in (g for g in s.gaps if g.metric.headline):
            note = needs_note(g.verdict.label, g.sd, g.seeds_needed, g.metric.margin_text)
            parts.append(
                f"{g.metric.label} {format_gap(g)} against {g.metric.margin_text}: {g.verdict.label}"
                + (f" ({note})" if note else "")
            )
            labels.append(g.verdict.label)
        lines.append(f"- {short_label(s.recipe)}: **{combine(labels)}** -- " + "; ".join(parts) + ".")
    left_out = _left_out(summaries)
    return [*lines, *(["", left_out] if left_out else []), ""]


def readme_table(record: DemoRecord) -> str:
    """The README-ready markdown: caption, one row per recipe (means over seeds), verdict sentences."""
    summaries = summarize(record.runs, record.recipes)
    base = summaries[0]
    seeds = ", ".join(str(s) for s in sorted({r.seed for r in record.runs}))
    s = record.settings
    head = ["recipe"]
    for m in METRICS:
        head += [m.label if m.relative else f"{m.label} ({s.n_test} held-out, greedy)", "gap"]
    head += ["tokens/s", "time per run", "vs baseline", "training steps vs baseline"]
    lines = [
        *headline(record),
        *text_section(record.text, {g: recipe_label(g) for g in record.recipes}),
        "**The reasoning task (arithmetic CPT -> SFT -> greedy accuracy).** Multi-step arithmetic with worked "
        "steps, every number one token; the null control (the FP8 code path with exact casts, a ~1e-7 "
        "perturbation per GEMM) is the noise floor an FP8 gap is read against.",
        "",
        f"`infir2 demo` on {record.date} ({record.machine or 'machine not recorded'}; {record.jobs} run(s) side "
        f"by side, {record.seconds / 60:.1f} min wall clock). Seeds {seeds} for every recipe (a seed sets the "
        f"initialization and the data order); values are means over seeds. A gap is FP8 minus the baseline "
        f"at the same seed (losses in %, accuracy in points): its mean over seeds and, in brackets, the two-sided "
        f"95% Student t-interval of that mean; the baseline's row shows its own seed-to-seed spread instead. Guessing the most common answer scores "
        f"{100 * record.chance_accuracy:.0f}%. Time per run: CPT + SFT + evaluation, wall clock (a process's "
        f"first run also pays its start-up); training steps: the optimizer steps alone."
        + (
            " Runs side by side share the cores, so times and tokens/s depend on what ran beside them."
            if record.jobs > 1
            else ""
        ),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for summary in summaries:
        cells = [recipe_label(summary.recipe)]
        for m, gap in zip(METRICS, _gap_cells(summary, base, record.runs), strict=True):
            mean = summary.means[m.key]
            cells += [_num(mean) if m.relative else _pct(mean), gap]
        cells += [
            f"{summary.tokens_per_s:.0f}",
            f"{summary.seconds:.0f} s",
            "—" if summary is base else f"{summary.time_ratio:.2f}x",
            "—" if summary is base or summary.train_ratio is None else f"{summary.train_ratio:.2f}x",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    null = next((x for x in summaries if x.recipe == NULL_CONTROL), None)
    lines += ["", *(f"- On the reasoning task: {verdict_sentence(x, null)}" for x in summaries[1:])]
    return "\n".join(lines) + "\n"


def report(record: DemoRecord) -> str:
    """``report.md``: the model and schedule, the README table with verdicts, every run, the plot."""
    s = record.settings
    lines = [
        "# infir2 demo report",
        "",
        f"Model: Qwen2-style, hidden {s.hidden_size}, {s.num_layers} layers, vocab {s.vocab_size}; "
        f"CPT {s.cpt_steps} steps x {s.cpt_batch} x {s.seq_len} tokens, then SFT {s.sft_epochs} epochs on "
        f"{s.n_train} arithmetic conversations; {s.n_test} held-out problems, greedy. Gaps are relative to "
        f"`{record.recipes[0]}` (first row). SFT losses end near zero, so their relative gaps look large. "
        "Held-out losses and accuracy are measured in high precision (FP8 GEMMs off, as the exported model "
        "runs) on the weights each recipe trained. Verdict per metric: equivalent when the gap's 95% "
        "t-interval lies inside the margin (+-2% CPT held-out loss, +-10% SFT val loss, +-3 accuracy points), "
        "worse / better when it excludes 0, else inconclusive: more seeds needed.",
        "",
        "![the verdict](verdict.png)",
        "",
        readme_table(record),
        "## Every run",
        "",
        "| recipe | seed | CPT loss (last step) | CPT held-out loss | SFT loss | SFT val loss | accuracy "
        "| unparseable | tokens/s | time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record.runs:
        lines.append(
            f"| {recipe_label(r.recipe)} | {r.seed} | {_num(r.cpt_loss)} | {_num(r.cpt_val_loss)} | "
            f"{_num(r.sft_loss)} | {_num(r.sft_val_loss)} | {_pct(r.accuracy)} | {r.unparseable} | "
            f"{r.tokens_per_s:.0f} | {r.seconds:.0f} s |"
        )
    lines += [
        "",
        "![loss curves](loss_curves.png)",
        "",
        "On a CPU the FP8 GEMMs are emulated (FP8 values, fp32 products), so FP8 is slower here; the",
        "point is the numerics. Per-step metrics: `runs/<recipe>/s<seed>/{cpt,sft}/metrics.jsonl`;",
        "per-problem answers: `runs/<recipe>/s<seed>/eval/samples.jsonl`; every figure above:",
        "`results.json` (`infir2 demo --report-only` renders this report again from it).",
    ]
    return "\n".join(lines) + "\n"


def render(out: Path, record: DemoRecord) -> str:
    """Write ``verdict.png``, ``loss_curves.png``, ``report.md`` and ``readme_table.md`` under ``out``;
    return the report."""
    plot_verdict(record, out / "verdict.png")
    plot_loss_curves(record, out / "loss_curves.png")
    (out / "readme_table.md").write_text(readme_table(record), encoding="utf-8")
    text = report(record)
    (out / "report.md").write_text(text, encoding="utf-8")
    return text


def update_readme(readme: Path, record: DemoRecord) -> None:
    """Replace what lies between the demo-table markers of ``readme`` with ``readme_table(record)``."""
    text = readme.read_text(encoding="utf-8")
    for marker in (README_START, README_END):
        count = text.count(marker)
        if count != 1:
            raise ValueError(
                f"{readme}: expected the marker {marker} once, found it {count} times; put "
                f"{README_START} and {README_END} on lines of their own around the demo table"
            )
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    if end < start:
        raise ValueError(f"{readme}: {README_END} comes before {README_START}")
    readme.write_text(f"{text[:start]}\n{readme_table(record)}{text[end:]}", encoding="utf-8")
