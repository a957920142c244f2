"""What a demo run is made of and what it leaves behind: its sizes (``DemoSettings``), one trained
model's numbers (``RecipeResult``, one per recipe and seed) and ``results.json`` (``DemoRecord``).

``results.json`` is the source of every figure the demo shows: ``report.md``, ``loss_curves.png`` and
the README table are rendered from it (``infir2 demo --report-only`` / ``--update-readme`` re-render
them without training), so a table can always be traced back to the runs that made it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = [
    "FULL",
    "QUICK",
    "DemoRecord",
    "DemoSettings",
    "RecipeResult",
]


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of one demo run. ``FULL`` is the README's demo; ``QUICK`` is for CI.

    ``seeds``: every recipe is trained once per seed (``run.seed`` of its CPT and SFT: initialization
    and data order); the same seed across recipes makes a paired comparison. The data and tokenizer
    are generated once, with ``data_seed``, and shared by every run.

    The fields stay one flat record, grouped by their comments (the data, the model, CPT and SFT, the
    real-text part): their names are the keys of ``results.json`` and what ``--set KEY=VALUE`` of
    ``benchmarks/demo_seeds.py`` and ``--demo-set`` of ``benchmarks/rl_study_sweep.py`` name;
    ``data_arguments`` names the fields that make the generated data.
    """

    seeds: tuple[int, ...] = (0, 1, 2)
    data_seed: int = 0
    max_operand: int = 9
    num_ops: tuple[int, int] = (2, 2)
    n_train: int = 1200
    n_test: int = 400  # 100 drew too few of the hard facts: runs at 99-100% there scored 95-99% on 400
    n_test_hard: int = 0  # problems of the harder split (one operation more) also evaluated; 0 = none
    n_cpt_worked: int = 3000
    # fact tables of the CPT corpus: 200 left the rare facts (17 + 7 = 24.) to chance (97-98%), 600 still
    # let one EPYC run fall to 96%; 1200 (40% of the corpus, the same CPT steps): 18 of 18 runs >= 98.5%
    n_cpt_tables: int = 1200
    cpt_val_fraction: float = 0.05  # of the CPT corpus, held out for the CPT held-out loss
    vocab_size: int = 400
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 8  # 4 heads left SFT on its plateau (third operand not copied) for up to 416 steps
    num_kv_heads: int = 4
    intermediate_size: int = 256  # the MLP's width (512: ~1.4x the step time, no better)
    seq_len: int = 64  # CPT window
    sft_max_length: int = 256  # tokens; a longer conversation is dropped
    cpt_steps: int = 700
    cpt_batch: int = 8
    sft_epochs: int = 8
    sft_batch: int = 16
    sft_tokens_per_micro_batch: int = 4096
    cpt_lr: float = 3e-3
    sft_lr: float = 2e-3
    min_lr_ratio: float = 0.0  # both schedules end at this fraction of their peak lr
    max_new_tokens: int = 64
    eval_batch_size: int = 200  # held-out problems generated at once
    # the real-text part (demo/text.py; infir2 fidelity's runs): 0 = skip it
    text_width: int = 256
    text_layers: int = 4
    text_vocab_size: int = 4096
    text_seq_len: int = 128
    text_batch: int = 8
    # 100 made the default demo 10.2 min on 2 idle cores (the budget is 10), 80 9.0-10.3 min on an EPYC whose
    # speed moves; 64 at lr 1e-3 keeps the paired gap as quiet (BENCHMARKS.md, "A fifth fewer steps")
    text_steps: int = 64
    text_lr: float = 1e-3  # 2e-3 left a paired gap sd of 0.27-0.44%; 1e-3 0.12%, the loss 0.4% higher
    # The read-out (BENCHMARKS.md, "The real-text leg's noise"): at lr 1e-3 the two runs of a pair stay
    # close (paired gap sd 0.12-0.13% over six seeds, whichever read-out), so a run's loss is its last
    # evaluation on the first 16 batches (128 windows, ~16k tokens), the cheapest one measured; at lr 2e-3
    # every window and a mean of the last three evaluations were needed to bring 0.36% to 0.27%.
    text_eval_batches: int = 16  # held-out batches of text_batch windows; 0 = every held-out window
    text_eval_every: int = 16  # held-out evaluations along the run (verdict.png's curves); 0: the last only
    text_eval_from: int = 0  # ... from this step on
    text_readout_evals: int = 1  # a run's held-out loss: the mean of its last this many evaluations
    text_max_chars: int | None = None  # the whole corpus
    text_null_control: bool = False  # the null control on real text too (off: time; real text is quiet)

    def data_arguments(self) -> dict[str, Any]:
        """The settings that make the generated data, as ``data.make_demo_data`` takes them (its
        ``seed`` is ``data_seed``): the one list of which fields are the data's."""
        return {"seed": self.data_seed, **{name: getattr(self, name) for name in DATA_FIELDS}}


#: the fields of ``DemoSettings`` (besides ``data_seed``) that make the generated data
DATA_FIELDS = ("n_train", "n_test", "n_cpt_worked", "n_cpt_tables", "max_operand", "num_ops", "n_test_hard")


# The setting of the seed studies (BENCHMARKS.md, "The reasoning task, seed by seed"): every number one
# token, so each copy from the question sits at a fixed distance; two layers; both schedules decayed to
# 0. SFT, not CPT, is where the model learns to copy the later operands: its loss leaves a plateau
# (the third operand not copied) at a step that varies by seed, and with 4 heads some runs never left
# it; 8 heads left it by step ~300 in every run measured. 400 held-out problems, splits sampled uniformly, and
# fact tables with every fact equally often make the accuracy a few runs can compare (98.5-99.75%
# over 18 runs).
FULL = DemoSettings()
# CI: the whole pipeline, each stage a few steps long; the numbers it prints mean nothing, that it runs
# end to end does. Two seeds, so that the paired statistics and the verdict run too; to keep CI as fast
# as with one seed, each run is half as long as the one-seed quick run was (5 CPT steps instead of 10,
# 96 SFT conversations instead of 160).
QUICK = DemoSettings(
    seeds=(0, 1),
    n_train=96,
    n_test=20,
    n_cpt_worked=200,
    n_cpt_tables=20,
    num_layers=2,
    intermediate_size=256,
    cpt_steps=5,
    sft_epochs=1,
    max_new_tokens=48,
    eval_batch_size=20,
    text_width=128,
    text_layers=1,
    text_vocab_size=320,
    text_seq_len=32,
    text_batch=4,
    text_steps=5,
    text_eval_batches=2,
    text_eval_every=2,
    text_eval_from=0,
    text_readout_evals=1,
    text_max_chars=60_000,
)


@dataclass
class RecipeResult:
    """One trained model (a recipe at a seed): final losses, held-out accuracy, speed, loss curves."""

    recipe: str
    seed: int
    cpt_loss: float  # the last CPT step's training loss (one batch)
    cpt_val_loss: float | None  # CPT held-out loss after the last step (the whole held-out split)
    sft_loss: float
    sft_val_loss: float | None  # SFT loss on the held-out conversations after the last step
    accuracy: float  # fraction of the held-out problems answered right (greedy)
    unparseable: int
    tokens_per_s: float  # median over the CPT and SFT steps
    seconds: float  # wall clock of CPT + SFT + evaluation
    train_seconds: float | None = None  # the CPT and SFT optimizer steps alone (no setup, export, evaluation)
    cpt_curve: list[tuple[int, float]] = field(default_factory=list)
    sft_curve: list[tuple[int, float]] = field(default_factory=list)
    hard_accuracy: float | None = None  # on the harder split (``n_test_hard`` problems); None: not evaluated


@dataclass
class DemoRecord:
    """Everything ``results.json`` holds: the settings, the recipes (the first is the baseline), every
    (recipe, seed) run, the chance accuracy of the held-out problems, and when / where it ran."""

    settings: DemoSettings
    recipes: list[str]
    runs: list[RecipeResult]
    chance_accuracy: float  # share of the most common answer among the held-out problems
    seconds: float  # the whole demo's wall clock
    jobs: int  # runs trained side by side
    machine: str = ""
    text: dict[str, Any] | None = None  # the real-text part: infir2 fidelity's result dict (demo/text.py)
    date: str = field(default_factory=lambda: datetime.now(timezone.utc).strftime("%Y-%m-%d"))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> DemoRecord:
        """Read ``results.json``; a missing file or key is an error that names the file and the key."""
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):  # no file at `path`
            raise ValueError(f"{path}: not found; run `infir2 demo --out {path.parent}` first") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(
                f"{path}: expected an object with 'settings' and 'runs' (an older demo's list?); "
                "rerun `infir2 demo`"
            )
        try:
            settings = _build(DemoSettings, raw["settings"], f"{path}: settings")
            runs = [_build(RecipeResult, r, f"{path}: runs[{i}]") for i, r in enumerate(raw["runs"])]
            top = {k: raw[k] for k in ("recipes", "chance_accuracy", "seconds", "jobs")}
        except KeyError as e:
            raise ValueError(f"{path}: missing key {e.args[0]!r}") from None
        settings = DemoSettings(
            **{**asdict(settings), "seeds": tuple(settings.seeds), "num_ops": tuple(settings.num_ops)}
        )  # JSON lists -> tuples
        for r in runs:
            r.cpt_curve = [(int(s), float(v)) for s, v in r.cpt_curve]
            r.sft_curve = [(int(s), float(v)) for s, v in r.sft_curve]
        return cls(
            settings=settings,
            runs=runs,
            machine=raw.get("machine", ""),
            date=raw.get("date", ""),
            text=raw.get("text"),
            **top,
        )


def _build(cls: Any, raw: dict[str, Any], where: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}")
    try:
        return cls(**raw)
    except TypeError as e:  # a required field is missing
        raise ValueError(f"{where}: {e}") from None
