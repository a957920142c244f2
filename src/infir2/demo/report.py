"""The demo's report: ``report.md`` (a table of losses, gaps to the baseline, accuracy, speed),
``loss_curves.png`` and ``results.json`` in the output folder.

Gaps are relative to the first recipe (the baseline). Chance accuracy is the share of the most
common answer among the held-out problems.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .pipeline import DemoSettings, RecipeResult

__all__ = ["RECIPE_LABELS", "plot", "report", "write_report"]

RECIPE_LABELS = {
    "bf16": "baseline (no FP8; fp32 on CPU)",
    "blockwise": "FP8 blockwise (1x128 / 128x128, InfiR2)",
    "blockwise_fp32scale": "FP8 blockwise, fp32 scales",
    "rowwise": "FP8 rowwise",
    "tensorwise": "FP8 tensorwise (naive)",
}


def plot(results: list[RecipeResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, stage in zip(axes, ("cpt", "sft"), strict=True):
        for r in results:
            curve = getattr(r, f"{stage}_curve")
            ax.plot([c[0] for c in curve], [c[1] for c in curve], label=RECIPE_LABELS.get(r.recipe, r.recipe))
        ax.set_title(f"{stage.upper()} training loss")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (per token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gap(value: float | None, base: float | None) -> str:
    if value is None or base is None or not base:
        return "-"
    return f"{100 * (value - base) / base:+.2f}%"


def _fmt(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f}"


def report(results: list[RecipeResult], s: DemoSettings, seconds: float, chance: float) -> str:
    base = results[0]
    lines = [
        "# infir2 demo report",
        "",
        f"Model: Qwen2-style, hidden {s.hidden_size}, {s.num_layers} layers, vocab {s.vocab_size}; "
        f"CPT {s.cpt_steps} steps x {s.cpt_batch} x {s.seq_len} tokens, then SFT {s.sft_epochs} epochs on "
        f"{s.n_train} arithmetic conversations; {s.n_test} held-out problems, greedy. "
        f"Total time {seconds / 60:.1f} min.",
        "",
        f"Gaps are relative to `{base.recipe}` (first row); SFT losses end near zero, so their relative "
        f"gaps look large. Chance accuracy (guessing the most common answer) is {100 * chance:.1f}%. "
        "One seed: the step at which this tiny model learns to copy the operands varies from run to run, "
        "so one run's accuracy differences between recipes can be run-to-run variation, not precision.",
        "",
        "| recipe | CPT loss | CPT gap | SFT loss | SFT val loss | val gap | accuracy | unparseable | tokens/s | time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {RECIPE_LABELS.get(r.recipe, r.recipe)} | {_fmt(r.cpt_loss)} | {_gap(r.cpt_loss, base.cpt_loss)} | "
            f"{_fmt(r.sft_loss)} | "
            f"{_fmt(r.sft_val_loss)} | {_gap(r.sft_val_loss, base.sft_val_loss)} | {100 * r.accuracy:.1f}% | "
            f"{r.unparseable} | {r.tokens_per_s:.0f} | {r.seconds:.0f} s |"
        )
    lines += [
        "",
        "![loss curves](loss_curves.png)",
        "",
        "On a CPU the FP8 GEMMs are emulated (dequantize to fp32, multiply), so FP8 is slower here; the",
        "point is the numerics. Per-step metrics: `runs/<recipe>/{cpt,sft}/metrics.jsonl`; per-problem",
        "answers: `runs/<recipe>/eval/samples.jsonl`.",
    ]
    return "\n".join(lines) + "\n"


def chance_accuracy(test_path: Path) -> float:
    answers = [json.loads(line)["answer"] for line in test_path.read_text(encoding="utf-8").splitlines()]
    return max(answers.count(a) for a in set(answers)) / len(answers)


def write_report(
    out: Path, results: list[RecipeResult], s: DemoSettings, seconds: float, test_path: Path
) -> str:
    """Write ``loss_curves.png``, ``report.md`` and ``results.json`` under ``out``; print and return the report."""
    plot(results, out / "loss_curves.png")
    text = report(results, s, seconds, chance_accuracy(test_path))
    (out / "report.md").write_text(text, encoding="utf-8")
    (out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1), encoding="utf-8")
    print(text)
    return text
