"""Evaluate a checkpoint on a reasoning benchmark (JSONL) or on held-out tokens (loss / perplexity).

Benchmark mode follows the InfiR2 protocol: system prompt "Please reason step by step, and put your
final answer within \\boxed{}.", the assistant turn opened with "<think>\\n", sampling at temperature
0.65 / top-p 0.95, N samples per problem, the answer taken from the last \\boxed{} after </think>.

  infir2 eval --model runs/qwen2.5-7b-sft-stage2/hf --task math --data aime24.jsonl --n 32 --max-new-tokens 32768
  infir2 eval --model out/fp8 --task math --greedy            # shipped sample benchmark, FP8 export
  infir2 eval --model runs/qwen2.5-7b-cpt/hf --perplexity data/cpt    # loss on data/cpt/val.bin

The protocol at scale, through a serving engine (vLLM, SGLang, `transformers serve`) that serves the
model under the name infir2, with infir2 rendering the prompts and grading the answers:

  vllm serve out/fp8 --served-model-name infir2 --max-model-len 32768
  infir2 eval --engine server --base-url http://127.0.0.1:8000 --model infir2 --tokenizer out/fp8 \\
      --preset aime24 --data aime24.jsonl --out runs/eval/aime24

Presets (--preset): aime24 / aime25 (math, n 32, 31000 new tokens), gpqa-diamond (multiple choice,
n 8, 26000), sampling 0.65 / 0.95; explicit flags override them.

Every finished sample is appended to <out>/completions.jsonl as it arrives: rerunning the same command
after an interruption generates only the missing samples; other settings in the same --out are refused.
The report: samples.jsonl (one line per sample), problems.jsonl (per problem), summary.json and
summary.md (avg@n, pass@k, unparseable and truncated counts) under --out.

--model is a Hugging Face folder (BF16/FP32) or an FP8 folder written by `infir2 export` (dequantized
on load); with --engine server, the served model name. Math items: {"problem", "answer", "id"?};
multiple choice: {"question", "choices", "answer" letter, "id"?}. Without --data the small sample
benchmark shipped with infir2 is used. --precision says what an in-process engine computes with: high
(the default: no FP8), fp8 (the model as deployed from its FP8 export: 128x128 weights made by the
export's quantizer, 1x128 activations, --scale-encoding pow2 or fp32), or recipe (`--precision recipe
--recipe NAME`: the projections converted with a training recipe, `infir2 config --keys` lists
fp8.recipe's names, and run in FP8). --engine takes any engine of the registry
(infir2.generation.ENGINES): builtin, server, vllm, or one registered by name.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from ..data.tokenizer import load_tokenizer
from ..generation import ENGINES, ServerEngine, check_prompt_fits
from ..model import (
    check_experts,
    check_model_folder,
    check_vocabulary,
    check_vocabulary_rows,
    config_limits,
)
from ..tasks import sample_path
from .builder import eval_config
from .completions import COMPLETIONS_FILE, CompletionLog, check_prompts, make_out_dir, read_saved
from .config import EvalConfig
from .engine_flags import (
    build_eval_engine,
    engine_preview,
    load_model,
)
from .flags import DEFAULT_MAX_NEW_TOKENS, add_arguments
from .presets import PRESETS
from .runner import render_prompts, run_evaluation

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "add_arguments", "run", "sample_path"]

log = logging.getLogger(__name__)


def _settings(cfg: EvalConfig, engine: str, label: str, extra_body: dict, dtype: str | None = None) -> dict:
    """What the samples depend on: a resumed run must match these (``completions.CompletionLog``);
    ``dtype``: the dtype an engine serves in where its preflight says one (vllm; absent for the other
    engines: their folders resume)."""
    b, s = cfg.benchmark, cfg.sampling
    return {
        "engine": engine,
        "model": cfg.model.path,
        "precision": label,
        "task": b.task,
        "system_prompt": b.system_prompt,
        "think_prefix": b.think_prefix,
        "greedy": s.greedy,
        "temperature": None if s.greedy else s.temperature,
        "top_p": None if s.greedy else s.top_p,
        "max_new_tokens": s.max_new_tokens,
        "extra_body": extra_body,
        **({"beyond_context": True} if s.beyond_context else {}),  # absent by default: old folders resume
        **({"dtype": dtype} if dtype else {}),
    }


def _expected_settings(cfg: EvalConfig) -> dict[str, Any] | None:
    """The settings the engine will report, from the config alone (before any weights are read); None
    where only the built engine knows its label (one registered by name without a preflight)."""
    if cfg.generation.engine == "server":
        return _settings(cfg, "server", ServerEngine.label, cfg.server.extra_body or {})
    preview = engine_preview(cfg)
    if preview is None:
        return None
    return _settings(cfg, cfg.generation.engine, preview.label, {}, preview.served_dtype)


def run(args: argparse.Namespace) -> int:
    from ..generation import ServerError

    cfg = eval_config(args)
    loss = cfg.loss
    if loss.tokens_dir:
        from .perplexity import check_loss_inputs

        check_model_folder(cfg.model.path)
        if cfg.generation.precision == "recipe":
            check_experts(cfg.model.path, cfg.generation.recipe or "", "--recipe")  # the conversion, on meta
        _check_out(Path(cfg.run.out))
        rows, positions = config_limits(cfg.model.path)  # the windows checked before any weights are read
        check_loss_inputs(loss.tokens_dir, loss.split, loss.seq_len, loss.max_windows, rows, positions)
        return _run_perplexity(load_model(cfg), cfg, Path(cfg.run.out))
    try:
        return _run_benchmark(cfg)
    except ServerError as e:
        print(f"infir2 eval: error: {e}", file=sys.stderr, flush=True)
        return 1


def _sample_and_grade(cfg: EvalConfig, problems: list, sampling: Any, out: Path) -> Any:
    """The engine of ``cfg`` over ``problems`` into ``out``'s completions log (resumed), graded."""
    from ..generation import ServerError

    b, tokenizer_dir = cfg.benchmark, cfg.model.tokenizer or cfg.model.path
    if cfg.generation.engine != "server":  # the model folder is named before the tokenizer read from it
        check_model_folder(cfg.model.path)
    tokenizer = load_tokenizer(tokenizer_dir)
    _preflight(cfg, tokenizer, render_prompts(tokenizer, problems, b.system_prompt, b.think_prefix), out)
    top = next((p for p in (out, *out.parents) if p.parent.exists()), out)  # the top folder made here
    created = None if top.exists() else top
    try:
        make_out_dir(out)  # a folder that cannot be made is said before the weights are read
        engine = build_eval_engine(cfg, tokenizer)  # an in-process engine reads the weights here
        if getattr(engine, "model", None) is not None:  # the loaded embedding, where config.json did not say
            check_vocabulary(engine.model, tokenizer, tokenizer_dir)
        preview = engine_preview(cfg) if cfg.generation.engine != "server" else None
        dtype = getattr(engine, "served_dtype", None) if preview and preview.served_dtype else None
        settings = _settings(cfg, engine.name, engine.label, getattr(engine, "extra_body", {}), dtype)
        completions = CompletionLog(out, settings)
    except BaseException:
        if created is not None:  # a refused start leaves no folder behind
            shutil.rmtree(created, ignore_errors=True)
        raise
    with completions:
        if done := len(completions.done):
            log.info("resuming %s: %d samples already in %s", out, done, completions.path)
        try:
            return run_evaluation(
                engine,
                tokenizer,
                problems,
                b.task,
                b.n,
                sampling,
                b.system_prompt,
                b.think_prefix,
                log=completions,
                seed=cfg.run.seed,
            )
        except (ServerError, ValueError) as e:  # one line: the error and what is kept
            if created is not None and not completions.done:  # nothing to resume: leave no folder behind
                completions.close()
                shutil.rmtree(created, ignore_errors=True)
                raise
            kept = f"{len(completions.done)} samples are saved in {completions.path}"
            raise type(e)(f"{e} ({kept}; rerun the same command to generate only the rest)") from None
        except Exception:
            log.error(
                "%d samples are saved in %s; rerun the same command to generate only the rest",
                len(completions.done),
                completions.path,
            )
            raise


def _preflight(cfg: EvalConfig, tokenizer, prompts: dict[str, str], out: Path) -> None:
    """Every refusal that needs no weights, before any are read: --out (a folder, or one that can be
    made, and writable), the samples saved there (drawn with these settings and prompts), and for an
    in-process engine the model's config.json (the tokenizer fits its embedding, the prompts and
    --max-new-tokens its positions). Writes nothing."""
    _check_out(out)
    expected = _expected_settings(cfg)
    if expected is not None and out.is_dir():
        saved = read_saved(out, expected)
        check_prompts(out / COMPLETIONS_FILE, saved.prompts, prompts)
    traits = ENGINES[cfg.generation.engine].traits
    if traits is None or not traits.in_process:
        return
    rows, positions = config_limits(cfg.model.path)
    check_vocabulary_rows(rows, tokenizer, cfg.model.tokenizer or cfg.model.path)
    if cfg.generation.precision == "recipe":
        check_experts(cfg.model.path, cfg.generation.recipe or "", "--recipe")  # the conversion, on meta
    longest = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts.values())
    check_prompt_fits(longest, positions, cfg.sampling.beyond_context)
    _check_budget(cfg, positions)


def _check_budget(cfg: EvalConfig, positions: int | None) -> None:
    """A --max-new-tokens past the model's positions (without --beyond-context) is refused when asked
    for, and said in one warning line when it is the default's or a preset's (each sample stops there)."""
    s = cfg.sampling
    if positions is None or s.beyond_context or s.max_new_tokens <= positions:
        return
    if s.max_new_tokens_from == "--max-new-tokens":
        raise ValueError(
            f"--max-new-tokens {s.max_new_tokens} is more than the model's {positions} positions "
            f"(max_position_embeddings in {Path(cfg.model.path) / 'config.json'}): a sample stops there "
            f"whatever the budget; give at most {positions}, or --beyond-context to run past them"
        )
    log.warning(
        "--max-new-tokens %d (%s) is more than the model's %d positions: each sample stops where prompt and "
        "response reach %d tokens (--beyond-context runs past them)",
        s.max_new_tokens,
        s.max_new_tokens_from,
        positions,
        positions,
    )


def _check_out(out: Path) -> None:
    """--out is a folder, or can be made one, and can be written: checked without making anything."""
    top = next((p for p in (out, *out.parents) if p.exists() or p.is_symlink()), Path("."))
    if not top.is_dir():
        raise ValueError(f"--out {out}: {top} is a file, not a folder")
    if not os.access(top, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {top} is not writable (a read-only folder); choose another --out")


def _run_benchmark(cfg: EvalConfig) -> int:
    from ..generation import SamplingConfig
    from ..tasks import load_problems

    b, s, out = cfg.benchmark, cfg.sampling, Path(cfg.run.out)
    data = Path(b.data) if b.data else sample_path(b.task)
    problems = load_problems(data, b.task)[: b.limit]
    if b.preset and b.limit is None and len(problems) != PRESETS[b.preset].problems:
        log.warning(
            "%s holds %d problems; the public %s set has %d",
            data,
            len(problems),
            b.preset,
            PRESETS[b.preset].problems,
        )
    sampling = SamplingConfig(
        greedy=s.greedy,
        temperature=s.temperature,
        top_p=s.top_p,
        max_new_tokens=s.max_new_tokens,
        batch_size=cfg.generation.batch_size,
        beyond_context=s.beyond_context,
    )
    result = _sample_and_grade(cfg, problems, sampling, out)
    result.summary = {"model": cfg.model.path, "data": str(data), **result.summary}
    result.save(out)
    print(result.markdown(), end="")
    truncated, samples = result.summary.get("truncated", 0), result.summary.get("samples", 0)
    if truncated:
        log.warning(
            "%d of %d samples were cut before finishing, at --max-new-tokens %d or (builtin engine) at the "
            "model's max_position_embeddings (scored as they stand); raise --max-new-tokens for reasoning "
            "models, or --beyond-context to run past the positions",
            truncated,
            samples,
            s.max_new_tokens,
        )
    print(f"results: {out}/samples.jsonl, {out}/problems.jsonl, {out}/summary.md")
    return 0


def _run_perplexity(model, cfg: EvalConfig, out: Path) -> int:
    from ..generation import apply_precision
    from .perplexity import evaluate_loss

    g, loss = cfg.generation, cfg.loss
    apply_precision(model, g.precision, g.recipe, g.scale_encoding)  # as the builtin engine applies them
    result = evaluate_loss(
        model,
        str(loss.tokens_dir),
        seq_len=loss.seq_len,
        batch_size=g.batch_size,
        max_windows=loss.max_windows,
        split=loss.split,
        fp8=g.precision == "recipe",
    )
    summary = {
        "model": cfg.model.path,
        "tokens_dir": loss.tokens_dir,
        "split": loss.split,
        "seq_len": loss.seq_len,
        **result.as_dict(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(
        f"loss {result.loss:.4f}  perplexity {result.perplexity:.3f}  over {result.tokens} tokens -> {out}/loss.json"
    )
    return 0
