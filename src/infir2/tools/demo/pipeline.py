"""The demo's pipeline: data, tokenizer, then per recipe and seed CPT -> SFT -> evaluation, side by side.

``run_demo(out, settings, recipes, jobs)`` generates the data (``data.py``, seed
``settings.data_seed``), trains the tokenizer, packs the CPT corpus -- all shared by every run -- then
runs ``run_recipe`` for each (recipe, seed) pair of ``recipes`` x ``settings.seeds`` (in worker
processes when ``jobs > 1``: each with its own threads, logging instead of progress bars) into
``runs/<recipe>/s<seed>/{cpt,sft,eval}``, saves ``results.json`` and renders the report from it
(``report.py``). A seed is ``run.seed`` of both the CPT and the SFT run: it sets the initialization and
the data order, so the same seed across recipes is a paired comparison. Every step is seeded, so the
numbers of a run are reproducible (timings aside). ``DemoSettings`` (``results.py``) are the sizes;
the CLI is ``command.py``.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ...data.cpt import prepare_cpt
from ...data.tokenizer import train_bpe_tokenizer
from ...data.tokens import heldout_windows, load_tokens
from ...train import parse_config, train
from ..bench.fidelity import cpt_data_section, cpu_run_section
from ..machine import machine_description
from ..recipe_spec import fp8_section
from .data import NUMBERS, make_demo_data, tokenizer_training_texts
from .report import render
from .results import FULL, QUICK, DemoRecord, DemoSettings, RecipeResult
from .text import plan_text, run_text, text_result, text_worker
from .workers import die_with_parent, start_worker

__all__ = [
    "FULL",
    "QUICK",
    "DemoSettings",
    "RecipeResult",
    "chance_accuracy",
    "data_only",
    "prepare_data",
    "run_demo",
    "run_recipe",
]

log = logging.getLogger(__name__)


_LOG_EVERY = 100  # steps between log lines when progress bars are off (recipes run side by side)


def _model_config(s: DemoSettings, vocab_size: int) -> dict[str, Any]:
    return {
        "arch": "qwen2",
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "max_position_embeddings": 2 * s.seq_len,
        "tie_word_embeddings": True,
        "vocab_size": vocab_size,
    }


def _run_name(recipe: str, seed: int, stage: str) -> str:
    return f"{recipe}/s{seed}/{stage}"  # under <out>/runs


def _cpt_eval_batches(out: Path, s: DemoSettings) -> int:
    """Batches that cover every held-out CPT window: the CPT held-out loss is the whole split's."""
    return max(
        1,
        math.ceil(len(heldout_windows(len(load_tokens(out / "cpt_tokens", "val")), s.seq_len)) / s.cpt_batch),
    )


def _cpt_config(s: DemoSettings, out: Path, recipe: str, seed: int, vocab_size: int) -> dict[str, Any]:
    return {
        "run": cpu_run_section(_run_name(recipe, seed, "cpt"), out / "runs", seed),
        "model": {
            "from_config": _model_config(s, vocab_size),
            "tokenizer": str(out / "tokenizer"),
            "precision": "fp32",
            "recompute_mlp": False,
        },  # a tiny model: memory is no concern
        "fp8": fp8_section(recipe),
        "data": cpt_data_section(out / "cpt_tokens", s.seq_len, s.cpt_batch),
        "optim": {"lr": s.cpt_lr, "weight_decay": 0.1, "grad_clip": 1.0},
        "schedule": {
            "name": "wsd",
            "warmup_fraction": 0.1,
            "decay_fraction": 0.25,
            "min_lr_ratio": s.min_lr_ratio,
        },
        # eval_every 0: no periodic evaluation, but the last step is evaluated (the CPT held-out loss)
        "train": {
            "max_steps": s.cpt_steps,
            "eval_every": 0,
            "eval_batches": _cpt_eval_batches(out, s),
            "save_every": 0,
            "keep_last": 1,
            "log_every": _LOG_EVERY,
        },
    }


def _sft_val_count(s: DemoSettings) -> int:
    """Conversations held out for the SFT val loss: a batch, or 5% of the training set if more."""
    return max(s.sft_batch, s.n_train // 20)


def _sft_config(
    s: DemoSettings, out: Path, recipe: str, seed: int, cpt_model: Path, data: dict[str, Path]
) -> dict[str, Any]:
    return {
        "run": cpu_run_section(_run_name(recipe, seed, "sft"), out / "runs", seed),
        "model": {
            "path": str(cpt_model),
            "tokenizer": str(out / "tokenizer"),
            "precision": "fp32",
            "recompute_mlp": False,
        },
        "fp8": fp8_section(recipe),
        "data": {
            "kind": "sft",
            "train_path": str(data["sft_train"]),
            "val_path": str(data["sft_val"]),
            "global_batch_size": s.sft_batch,
            "max_tokens_per_micro_batch": s.sft_tokens_per_micro_batch,
            "max_length": s.sft_max_length,
            "overlong": "drop",
            "epochs": s.sft_epochs,
        },
        "optim": {"lr": s.sft_lr, "weight_decay": 0.0, "grad_clip": 1.0},
        "schedule": {"name": "cosine", "warmup_fraction": 0.05, "min_lr_ratio": s.min_lr_ratio},
        # the last step evaluates every held-out conversation
        "train": {
            "eval_every": 0,
            "eval_batches": math.ceil(_sft_val_count(s) / s.sft_batch),
            "save_every": 0,
            "keep_last": 1,
            "log_every": _LOG_EVERY,
        },
    }


def _split_sft(path: Path, val_count: int) -> tuple[Path, Path]:
    """Hold the last ``val_count`` conversations out as a validation file (for the SFT val loss)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    train_path, val_path = path.with_name("sft_train_split.jsonl"), path.with_name("sft_val.jsonl")
    train_path.write_text("".join(f"{line}\n" for line in lines[:-val_count]), encoding="utf-8")
    val_path.write_text("".join(f"{line}\n" for line in lines[-val_count:]), encoding="utf-8")
    return train_path, val_path


def prepare_data(out: Path, s: DemoSettings) -> tuple[dict[str, Path], Any]:
    """Demo data, tokenizer (saved to ``out/tokenizer``) and CPT token shards (``out/cpt_tokens``).

    SFT conversations: ``out/data/sft_train_split.jsonl`` and ``out/data/sft_val.jsonl``. The tiny
    configs (``configs/tiny-*.yaml``) read exactly these paths under ``runs/tiny``.
    """
    data = make_demo_data(out / "data", **s.data_arguments())
    tokenizer = train_bpe_tokenizer(tokenizer_training_texts(data), s.vocab_size, whole_numbers=NUMBERS)
    data["sft_train"], data["sft_val"] = _split_sft(data["sft_train"], _sft_val_count(s))
    tokenizer.save_pretrained(out / "tokenizer")
    prepare_cpt([data["cpt"]], out / "cpt_tokens", tokenizer, val_fraction=s.cpt_val_fraction, progress=False)
    return data, tokenizer


def _read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The whole run's per-step metrics (``metrics.jsonl`` stays one clean run across resumes)."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _curve(history: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in history if not m.get("skipped")]


def _last(history: list[dict[str, Any]], key: str) -> float | None:
    values = [m[key] for m in history if key in m and not m.get("skipped")]
    return values[-1] if values else None


def _median(values: list[float]) -> float:
    values = sorted(v for v in values if math.isfinite(v))
    return values[len(values) // 2] if values else math.nan


def _greedy_eval(model: Any, tokenizer: Any, path: Path, s: DemoSettings, saved: Path, progress: bool) -> Any:
    """The demo's reasoning evaluation (greedy, the protocol's budget) of the problems at ``path``,
    saved to ``saved``."""
    from ...eval import evaluate, load_problems

    result = evaluate(
        model,
        tokenizer,
        load_problems(path, "math"),
        task="math",
        greedy=True,
        max_new_tokens=s.max_new_tokens,
        batch_size=s.eval_batch_size,
        progress=progress,
    )
    result.save(saved)
    return result


def train_cpt(
    s: DemoSettings, out: Path, recipe: str, seed: int, tokenizer: Any, progress: bool = False
) -> Any:
    """The demo's CPT of ``recipe`` at ``seed``, in ``OUT/runs/<recipe>/s<seed>/cpt`` (its ``TrainResult``)."""
    name = _run_name(recipe, seed, "cpt")
    cfg = parse_config(_cpt_config(s, out, recipe, seed, len(tokenizer)), f"demo:{name}")
    return train(cfg, tokenizer=tokenizer, progress=progress)


def train_sft(
    s: DemoSettings,
    out: Path,
    recipe: str,
    seed: int,
    cpt_model: Path,
    data: dict[str, Path],
    tokenizer: Any,
    stage: str = "sft",
    progress: bool = False,
) -> Any:
    """The demo's SFT with ``s``'s settings from ``cpt_model``, in ``OUT/runs/<recipe>/s<seed>/<stage>``."""
    cfg = _sft_config(s, out, recipe, seed, cpt_model, data)
    cfg["run"]["name"] = _run_name(recipe, seed, stage)
    return train(parse_config(cfg, f"demo:{cfg['run']['name']}"), tokenizer=tokenizer, progress=progress)


def run_recipe(
    recipe: str,
    seed: int,
    out: Path,
    s: DemoSettings,
    data: dict[str, Path],
    tokenizer: Any,
    progress: bool = True,
) -> RecipeResult:
    """CPT, then SFT, then the reasoning evaluation, for one recipe at one seed."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    cpt = train_cpt(s, out, recipe, seed, tokenizer, progress)
    assert cpt.hf_dir is not None
    sft = train_sft(s, out, recipe, seed, cpt.hf_dir, data, tokenizer, progress=progress)
    assert sft.hf_dir is not None
    model = AutoModelForCausalLM.from_pretrained(sft.hf_dir, local_files_only=True).float().eval()
    runs = out / "runs"
    result = _greedy_eval(model, tokenizer, data["test"], s, runs / _run_name(recipe, seed, "eval"), progress)
    accuracy = float(result.summary["avg@n"])
    n = len(result.problems)
    log.info("demo: %s seed %d: accuracy %.1f%% on %d held-out problems", recipe, seed, 100 * accuracy, n)
    hard = None
    if s.n_test_hard:
        saved = runs / _run_name(recipe, seed, "eval_hard")
        hard = float(_greedy_eval(model, tokenizer, data["test_hard"], s, saved, progress).summary["avg@n"])
    cpt_metrics, sft_metrics = _read_metrics(cpt.run_dir), _read_metrics(sft.run_dir)
    return RecipeResult(
        recipe=recipe,
        seed=seed,
        cpt_loss=_last(cpt_metrics, "loss") or math.nan,
        cpt_val_loss=_last(cpt_metrics, "val_loss"),
        sft_loss=_last(sft_metrics, "loss") or math.nan,
        sft_val_loss=_last(sft_metrics, "val_loss"),
        accuracy=accuracy,
        unparseable=int(result.summary.get("unparseable", 0)),
        tokens_per_s=_median([m["tokens_per_s"] for m in cpt_metrics + sft_metrics if "tokens_per_s" in m]),
        seconds=time.perf_counter() - t0,
        train_seconds=sum(m["step_time_s"] for m in cpt_metrics + sft_metrics if "step_time_s" in m),
        cpt_curve=_curve(cpt_metrics),
        sft_curve=_curve(sft_metrics),
        hard_accuracy=hard,
    )


def chance_accuracy(test_path: Path) -> float:
    """The share of the most common answer among the held-out problems (a guesser's accuracy)."""
    answers = [json.loads(line)["answer"] for line in test_path.read_text(encoding="utf-8").splitlines()]
    return max(answers.count(a) for a in set(answers)) / len(answers)


_MARKER = "demo.json"


def _fresh_output(out: Path, settings: DemoSettings, recipes: list[str]) -> None:
    """Start from an empty folder; a previous demo's folder (it has ``demo.json``) is cleared first."""
    if out.exists() and any(out.iterdir()):
        if not (out / _MARKER).is_file():
            raise ValueError(
                f"--out {out} is not empty and holds no earlier demo ({_MARKER}); choose another folder"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / _MARKER).write_text(json.dumps({"settings": asdict(settings), "recipes": recipes}, indent=1))


def _run_worker(
    recipe: str, seed: int, out: Path, s: DemoSettings, data: dict[str, Path], threads: int
) -> RecipeResult:
    """One (recipe, seed) run in a worker process: its own threads, log lines instead of progress bars."""
    from ...data.tokenizer import load_tokenizer

    start_worker(threads, f"{recipe} s{seed}")
    return run_recipe(recipe, seed, out, s, data, load_tokenizer(out / "tokenizer"), progress=False)


def data_only(out: Path, settings: DemoSettings) -> dict[str, Path]:
    """Only the data: tokenizer, CPT shards and SFT files in ``out`` (what the tiny configs need)."""
    _fresh_output(out, settings, [])
    data, _ = prepare_data(out, settings)
    return {"tokenizer": out / "tokenizer", "cpt": out / "cpt_tokens", **data}


def _torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def _longest_first(pairs: list[tuple[str, int]], baseline: str) -> list[tuple[str, int]]:
    """``pairs`` with the baseline's runs last (the order of the rest kept): a CPU emulates FP8, so
    the baseline's runs are the shortest."""
    return sorted(pairs, key=lambda pair: pair[0] == baseline)


def _train_all(
    out: Path,
    settings: DemoSettings,
    recipes: list[str],
    jobs: int,
    data: dict[str, Path],
    tokenizer: Any,
    finished: list[RecipeResult],
) -> tuple[Any, int, int]:
    """Every (recipe, seed) run, appended to ``finished`` in order as each is collected, then the
    real-text part: ``(its result, jobs, threads)``."""
    pairs = [(recipe, seed) for recipe in recipes for seed in settings.seeds]
    jobs = max(1, min(jobs, len(pairs)))
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else _torch_threads()
    text_out = out / "text"  # the verdict's part: real text (demo/text.py)
    if jobs == 1:
        for i, (recipe, seed) in enumerate(pairs, 1):
            log.info("demo: run %d/%d: %s, seed %d", i, len(pairs), recipe, seed)
            finished.append(run_recipe(recipe, seed, out, settings, data, tokenizer))
        text = run_text(text_out, settings, recipes)
    else:
        log.info(
            "demo: %d runs (%d recipes x %d seeds), %d at a time (%d thread(s) each); progress is logged "
            "every %d steps",
            len(pairs),
            len(recipes),
            len(settings.seeds),
            jobs,
            threads,
            _LOG_EVERY,
        )
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            jobs, mp_context=context, initializer=die_with_parent, initargs=(os.getpid(),)
        ) as pool:
            # Longest first, so that the cores finish together: the FP8 runs (emulated: ~1.4x the
            # baseline's time) before the baseline's, the reasoning runs before the shorter real-text
            # runs, which queue behind them in the same pool (no core waits for the last reasoning
            # run to end); their corpus is prepared here meanwhile.
            futures = {
                (r, seed): pool.submit(_run_worker, r, seed, out, settings, data, threads)
                for r, seed in _longest_first(pairs, recipes[0])
            }
            plan = plan_text(text_out, settings, recipes)
            text_futures = (
                {
                    (r, seed): pool.submit(text_worker, text_out, plan.settings, r, seed, threads)
                    for r, seed in _longest_first(plan.pairs, recipes[0])
                }
                if plan is not None
                else {}
            )
            finished.extend(futures[pair].result() for pair in pairs)
            text_runs = [text_futures[pair].result() for pair in plan.pairs] if plan is not None else []
        text = text_result(plan, text_runs) if plan is not None else None
    return text, jobs, threads


def run_demo(out: Path, settings: DemoSettings, recipes: list[str], jobs: int = 1) -> DemoRecord:
    """The whole demo: every recipe at every seed of ``settings.seeds``, then ``results.json`` and the report.

    ``jobs > 1`` runs (recipe, seed) pairs side by side in worker processes (one thread each when there
    are fewer cores than jobs): this tiny model's small GEMMs use a second thread poorly, so
    single-threaded runs side by side get through more work than one run on two threads."""
    t0 = time.perf_counter()
    _fresh_output(out, settings, recipes)
    log.info("demo: generating data and training the tokenizer in %s", out)
    data, tokenizer = prepare_data(out, settings)
    pairs = [(recipe, seed) for recipe in recipes for seed in settings.seeds]
    finished: list[RecipeResult] = []
    try:
        text, jobs, threads = _train_all(out, settings, recipes, jobs, data, tokenizer, finished)
    except Exception as e:  # one line: what is kept and what a rerun does; no results.json of a part
        kept = (
            f"{len(finished)} of {len(pairs)} runs had finished in {out}, no results.json written: the same "
            f"command again starts the demo over (it clears {out})"
        )
        if isinstance(e, ValueError):
            raise ValueError(f"{e} ({kept})") from e
        log.error("demo: %s", kept)
        raise
    results = finished
    record = DemoRecord(
        settings=settings,
        recipes=recipes,
        runs=results,
        chance_accuracy=chance_accuracy(data["test"]),
        seconds=time.perf_counter() - t0,
        jobs=jobs,
        machine=machine_description(threads),
        text=text,
    )
    record.save(out / "results.json")
    print(render(out, record))
    return record
