"""The demo's report, rendered from ``results.json`` alone: ``report.md``, ``readme_table.md`` and
``loss_curves.png`` in the output folder, and the README's demo table.

* ``readme_table(record)``: the README-ready table -- per recipe the means over seeds, each FP8 gap to
  the baseline as the mean over paired seeds with its 95% t-interval (the baseline's row shows its own
  seed spread), speed
  relative to the baseline -- and the generated verdict sentences (``summary.py``).
* ``report(record)``: that table, plus the model and schedule, and every (recipe, seed) run.
* ``update_readme(readme, record)``: replaces the block between ``README_START`` and ``README_END`` in a
  README with ``readme_table(record)``; nothing else in the file changes.
"""

from __future__ import annotations

from pathlib import Path

from ..bench.fidelity_report import save_figure
from .results import DemoRecord, RecipeResult
from .summary import (
    METRICS,
    NULL_CONTROL,
    RECIPE_LABELS,
    RecipeSummary,
    format_gap,
    format_spread,
    short_label,
    summarize,
    verdict_sentence,
)
from .text import text_section

__all__ = ["README_END", "README_START", "plot", "readme_table", "render", "report", "update_readme"]

README_START = "<!-- demo-table:start -->"
README_END = "<!-- demo-table:end -->"

_BASELINE_COLOUR = "black"
_FP8_COLOURS = ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange")
_SEED_STYLES = ("-", "--", ":", "-.")


def plot(record: DemoRecord, path: Path) -> None:
    """CPT and SFT training loss of every run: a colour per recipe (the baseline black), a line style per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {r: _FP8_COLOURS[i % len(_FP8_COLOURS)] for i, r in enumerate(record.recipes[1:])}
    colours[record.recipes[0]] = _BASELINE_COLOUR
    seeds = sorted({r.seed for r in record.runs})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, stage in zip(axes, ("cpt", "sft"), strict=True):
        for r in record.runs:
            curve = getattr(r, f"{stage}_curve")
            ax.plot(
                [c[0] for c in curve],
                [c[1] for c in curve],
                color=colours.get(r.recipe),
                linestyle=_SEED_STYLES[seeds.index(r.seed) % len(_SEED_STYLES)],
                linewidth=1,
                label=f"{short_label(r.recipe)}, seed {r.seed}",
            )
        ax.set_title(f"{stage.upper()} training loss")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (per token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


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
        *text_section(record.text, RECIPE_LABELS),
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
        cells = [RECIPE_LABELS.get(summary.recipe, summary.recipe)]
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
        readme_table(record),
        "## Every run",
        "",
        "| recipe | seed | CPT loss (last step) | CPT held-out loss | SFT loss | SFT val loss | accuracy "
        "| unparseable | tokens/s | time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record.runs:
        lines.append(
            f"| {RECIPE_LABELS.get(r.recipe, r.recipe)} | {r.seed} | {_num(r.cpt_loss)} | {_num(r.cpt_val_loss)} | "
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
    """Write ``loss_curves.png``, ``report.md`` and ``readme_table.md`` under ``out``; return the report."""
    plot(record, out / "loss_curves.png")
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
