"""The demo's pipeline: data, tokenizer, then per recipe CPT -> SFT -> evaluation, side by side.

``run_demo(out, settings, recipes, jobs)`` generates the data (``data.demo``), trains the tokenizer,
packs the CPT corpus, runs ``run_recipe`` for each recipe (in worker processes when ``jobs > 1``: each
with its own threads, logging instead of progress bars) and hands the results to ``report.py``. Every
step is seeded, so the numbers of a run are reproducible (timings aside). ``DemoSettings`` are the
sizes; ``FULL`` fits 10 minutes on 2 CPU cores, ``QUICK`` is the CI run. The CLI is ``command.py``.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..data.cpt import prepare_cpt
from ..data.demo import make_demo_data, tokenizer_training_texts
from ..data.tokenizer import train_bpe_tokenizer
from ..train import parse_config, train
from .report import write_report

__all__ = [
    "FULL",
    "QUICK",
    "DemoSettings",
    "RecipeResult",
    "data_only",
    "prepare_data",
    "run_demo",
    "run_recipe",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of one demo run. ``FULL`` fits 10 minutes on 2 CPU cores; ``QUICK`` is for CI."""

    max_operand: int = 9
    num_ops: tuple[int, int] = (2, 2)
    n_train: int = 1200
    n_test: int = 100
    n_cpt_worked: int = 3000
    n_cpt_tables: int = 200
    vocab_size: int = 400
    hidden_size: int = 128
    num_layers: int = 4
    intermediate_size: int = 512
    seq_len: int = 64  # CPT window
    sft_max_length: int = 256
    cpt_steps: int = 900
    cpt_batch: int = 8
    sft_epochs: int = 2
    sft_batch: int = 16
    sft_tokens_per_micro_batch: int = 4096
    cpt_lr: float = 3e-3
    sft_lr: float = 1e-3
    max_new_tokens: int = 64
    eval_batch_size: int = 50


# Tuned on the development CPU (see README): small batches and many steps teach this tiny model more
# per second than large batches; the rendered conversations in the CPT corpus teach it to copy the
# operands from the question, which SFT alone did not manage in the budget.
FULL = DemoSettings()
QUICK = DemoSettings(n_train=160, n_test=20, n_cpt_worked=200, n_cpt_tables=20, num_layers=2,
                     intermediate_size=256, cpt_steps=10, sft_epochs=1, max_new_tokens=48,
                     eval_batch_size=20)  # fmt: skip

_LOG_EVERY = 100  # steps between log lines when progress bars are off (recipes run side by side)


@dataclass
class RecipeResult:
    recipe: str
    cpt_loss: float
    cpt_val_loss: float | None
    sft_loss: float
    sft_val_loss: float | None
    accuracy: float
    unparseable: int
    tokens_per_s: float
    seconds: float
    cpt_curve: list[tuple[int, float]] = field(default_factory=list)
    sft_curve: list[tuple[int, float]] = field(default_factory=list)


def _model_config(s: DemoSettings, vocab_size: int) -> dict[str, Any]:
    return {"arch": "qwen2", "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
            "num_hidden_layers": s.num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 2 * s.seq_len, "tie_word_embeddings": True,
            "vocab_size": vocab_size}  # fmt: skip


def _cpt_config(s: DemoSettings, out: Path, recipe: str, vocab_size: int) -> dict[str, Any]:
    return {
        "run": {"name": f"{recipe}/cpt", "out_dir": str(out / "runs"), "seed": 0, "device": "cpu"},
        "model": {"from_config": _model_config(s, vocab_size), "tokenizer": str(out / "tokenizer"),
                  "precision": "fp32"},
        "fp8": {"recipe": recipe},
        "data": {"kind": "cpt", "train_path": str(out / "cpt_tokens"), "seq_len": s.seq_len,
                 "global_batch_size": s.cpt_batch, "micro_batch_size": s.cpt_batch},
        "optim": {"lr": s.cpt_lr, "weight_decay": 0.1, "grad_clip": 1.0},
        "schedule": {"name": "wsd", "warmup_fraction": 0.1, "decay_fraction": 0.25, "min_lr_ratio": 0.1},
        "train": {"max_steps": s.cpt_steps, "eval_every": 0, "eval_batches": 4, "save_every": 0, "keep_last": 1,
                  "log_every": _LOG_EVERY},
    }  # fmt: skip


def _sft_config(
    s: DemoSettings, out: Path, recipe: str, cpt_model: Path, data: dict[str, Path]
) -> dict[str, Any]:
    return {
        "run": {"name": f"{recipe}/sft", "out_dir": str(out / "runs"), "seed": 0, "device": "cpu"},
        "model": {"path": str(cpt_model), "tokenizer": str(out / "tokenizer"), "precision": "fp32"},
        "fp8": {"recipe": recipe},
        "data": {"kind": "sft", "train_path": str(data["sft_train"]), "val_path": str(data["sft_val"]),
                 "global_batch_size": s.sft_batch, "max_tokens_per_micro_batch": s.sft_tokens_per_micro_batch,
                 "max_length": s.sft_max_length, "overlong": "drop", "epochs": s.sft_epochs},
        "optim": {"lr": s.sft_lr, "weight_decay": 0.0, "grad_clip": 1.0},
        "schedule": {"name": "cosine", "warmup_fraction": 0.05, "min_lr_ratio": 0.1},
        "train": {"eval_every": 0, "eval_batches": 4, "save_every": 0, "keep_last": 1, "log_every": _LOG_EVERY},
    }  # fmt: skip


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
    data = make_demo_data(out / "data", seed=0, n_train=s.n_train, n_test=s.n_test, n_cpt_worked=s.n_cpt_worked,
                          n_cpt_tables=s.n_cpt_tables, max_operand=s.max_operand, num_ops=s.num_ops)  # fmt: skip
    tokenizer = train_bpe_tokenizer(tokenizer_training_texts(data), s.vocab_size)
    data["sft_train"], data["sft_val"] = _split_sft(data["sft_train"], max(s.sft_batch, s.n_train // 20))
    tokenizer.save_pretrained(out / "tokenizer")
    prepare_cpt([data["cpt"]], out / "cpt_tokens", tokenizer, val_fraction=0.05, progress=False)
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


def run_recipe(
    recipe: str, out: Path, s: DemoSettings, data: dict[str, Path], tokenizer: Any, progress: bool = True
) -> RecipeResult:
    """CPT, then SFT, then the reasoning evaluation, for one recipe."""
    from transformers import AutoModelForCausalLM

    from ..eval import evaluate, load_problems

    t0 = time.perf_counter()
    cpt = train(parse_config(_cpt_config(s, out, recipe, len(tokenizer)), f"demo:{recipe}/cpt"),
                tokenizer=tokenizer, progress=progress)  # fmt: skip
    assert cpt.hf_dir is not None
    sft = train(parse_config(_sft_config(s, out, recipe, cpt.hf_dir, data), f"demo:{recipe}/sft"),
                tokenizer=tokenizer, progress=progress)  # fmt: skip
    assert sft.hf_dir is not None
    model = AutoModelForCausalLM.from_pretrained(sft.hf_dir, local_files_only=True).float().eval()
    problems = load_problems(data["test"], "math")
    result = evaluate(model, tokenizer, problems, task="math", greedy=True, max_new_tokens=s.max_new_tokens,
                      batch_size=s.eval_batch_size, progress=progress)  # fmt: skip
    log.info("demo: %s: accuracy %.1f%% on %d held-out problems", recipe, 100 * result.summary["avg@n"],
             len(problems))  # fmt: skip
    result.save(out / "runs" / recipe / "eval")
    cpt_metrics, sft_metrics = _read_metrics(cpt.run_dir), _read_metrics(sft.run_dir)
    return RecipeResult(
        recipe=recipe,
        cpt_loss=_last(cpt_metrics, "loss") or math.nan,
        cpt_val_loss=_last(cpt_metrics, "val_loss"),
        sft_loss=_last(sft_metrics, "loss") or math.nan,
        sft_val_loss=_last(sft_metrics, "val_loss"),
        accuracy=float(result.summary["avg@n"]),
        unparseable=int(result.summary.get("unparseable", 0)),
        tokens_per_s=_median([m["tokens_per_s"] for m in cpt_metrics + sft_metrics if "tokens_per_s" in m]),
        seconds=time.perf_counter() - t0,
        cpt_curve=_curve(cpt_metrics),
        sft_curve=_curve(sft_metrics),
    )


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


def _recipe_worker(
    recipe: str, out: Path, s: DemoSettings, data: dict[str, Path], threads: int
) -> RecipeResult:
    """One recipe in a worker process: its own threads, log lines instead of progress bars."""
    import torch

    from ..data.tokenizer import load_tokenizer

    torch.set_num_threads(threads)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [{recipe}] %(message)s", datefmt="%H:%M:%S", force=True
    )  # a reused worker process logs under its new recipe
    return run_recipe(recipe, out, s, data, load_tokenizer(out / "tokenizer"), progress=False)


def data_only(out: Path, settings: DemoSettings) -> dict[str, Path]:
    """Only the data: tokenizer, CPT shards and SFT files in ``out`` (what the tiny configs need)."""
    _fresh_output(out, settings, [])
    data, _ = prepare_data(out, settings)
    return {"tokenizer": out / "tokenizer", "cpt": out / "cpt_tokens", **data}


def run_demo(out: Path, settings: DemoSettings, recipes: list[str], jobs: int = 1) -> list[RecipeResult]:
    """The whole demo. ``jobs > 1`` runs recipes side by side in worker processes (one thread each
    when there are fewer cores than jobs): this tiny model's small GEMMs use a second thread poorly,
    so single-threaded runs side by side get through more work than one run on two threads."""
    t0 = time.perf_counter()
    _fresh_output(out, settings, recipes)
    log.info("demo: generating data and training the tokenizer in %s", out)
    data, tokenizer = prepare_data(out, settings)
    jobs = max(1, min(jobs, len(recipes)))
    if jobs == 1:
        results = []
        for i, recipe in enumerate(recipes, 1):
            log.info("demo: recipe %d/%d: %s", i, len(recipes), recipe)
            results.append(run_recipe(recipe, out, settings, data, tokenizer))
    else:
        threads = max(1, (os.cpu_count() or 1) // jobs)
        log.info("demo: %d recipes, %d at a time (%d thread(s) each); progress is logged every %d steps",
                 len(recipes), jobs, threads, _LOG_EVERY)  # fmt: skip
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=context) as pool:
            futures = [pool.submit(_recipe_worker, r, out, settings, data, threads) for r in recipes]
            results = [f.result() for f in futures]
    write_report(out, results, settings, time.perf_counter() - t0, data["test"])
    return results
