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

from ..data.chat import SYSTEM_PROMPT, THINK_PREFIX
from ..data.tokenizer import load_tokenizer
from ..generation import ENGINES, ServerEngine, check_prompt_fits
from ..model import (
    check_experts,
    check_model_folder,
    check_vocabulary,
    check_vocabulary_rows,
    config_limits,
    resolve_device,
)
from ..tasks import TASKS, sample_path
from .completions import COMPLETIONS_FILE, CompletionLog, check_prompts, make_out_dir, read_saved
from .engine_flags import (
    add_engine_arguments,
    build_eval_engine,
    check_engine_flags,
    check_server_flags,
    load_model,
    parse_extra_body,
)
from .mode_flags import check_mode_flags, check_recipe
from .presets import PRESETS
from .runner import render_prompts, run_evaluation

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "add_arguments", "run", "sample_path"]

DEFAULT_MAX_NEW_TOKENS = 32768  # the InfiR2 evaluation budget (its 32k context): reasoning is long
#: values used when neither the flag nor a preset sets them
DEFAULTS: dict[str, Any] = {
    "task": "math",
    "n": 1,
    "temperature": 0.65,
    "top_p": 0.95,
    "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
}

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="checkpoint folder (HF BF16/FP32, or FP8 from `infir2 export`); with --engine server, "
        "the model name the server serves",
    )
    p.add_argument("--tokenizer", help="tokenizer folder that renders the prompts (default: --model)")
    p.add_argument(
        "--preset",
        choices=list(PRESETS),
        help="the authors' protocol for a benchmark: task, --n, --max-new-tokens, sampling "
        "(needs --data: your local copy of its problems)",
    )
    p.add_argument(
        "--task",
        choices=list(TASKS),
        help="answer format, a task of the registry, unless a preset sets it (default: math)",
    )
    p.add_argument("--data", help="benchmark JSONL (default: the shipped sample for --task)")
    p.add_argument(
        "--n", type=int, help="samples per problem (avg@n, pass@k), unless a preset sets it (default: 1)"
    )
    p.add_argument("--greedy", action="store_true", help="greedy decoding (requires --n 1)")
    p.add_argument(
        "--temperature", type=float, help="sampling temperature, unless a preset sets it (default: 0.65)"
    )
    p.add_argument(
        "--top-p", type=float, help="nucleus sampling threshold, unless a preset sets it (default: 0.95)"
    )
    p.add_argument(
        "--beyond-context",
        action="store_true",
        help="builtin engine: run past the model's max_position_embeddings (RoPE extrapolation, on purpose); "
        "by default a longer prompt is refused and each sample stops at the model's positions (truncated)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"generation budget per sample, unless a preset sets it (default: {DEFAULT_MAX_NEW_TOKENS}); reasoning traces need "
        "tens of thousands, generation stops earlier at the end-of-turn token, and samples cut "
        "here are counted as truncated (with a warning); builtin engine: a budget past the model's positions "
        "is refused (samples stop there; --beyond-context runs past them), a default's or preset's is said",
    )
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--system-prompt", help="system turn of every prompt (default: the protocol's)")
    prompt.add_argument("--no-system-prompt", action="store_true", help="prompts without a system turn")
    think = p.add_mutually_exclusive_group()
    think.add_argument("--think-prefix", help="text that opens the assistant turn (default: '<think>\\n')")
    think.add_argument("--no-think-prefix", action="store_true", help="leave the assistant turn empty")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--limit", type=int, help="only the first LIMIT problems")
    p.add_argument(
        "--out",
        default="eval_out",
        help="output folder; a rerun into the same folder resumes (default: eval_out)",
    )
    p.add_argument(
        "--engine",
        choices=list(ENGINES),
        default="builtin",
        help="builtin: the KV-cache engine in this process; server: an OpenAI-compatible /v1/completions "
        "endpoint (vLLM, SGLang, transformers serve); vllm: an in-process vllm.LLM; or one registered by name",
    )
    add_engine_arguments(p)
    g = p.add_argument_group("held-out loss (instead of a benchmark)")
    g.add_argument("--perplexity", metavar="TOKEN_DIR", help="folder with val.bin + meta.json")
    g.add_argument("--split", help="token file name without .bin (default: val)")
    g.add_argument("--seq-len", type=int, help="context per window (default 1024)")
    g.add_argument("--max-windows", type=int, help="score only the first N windows")


def _check_numbers(args: argparse.Namespace) -> None:
    """Every numeric flag in its range, named by its flag (the libraries below name their own fields)."""
    import math

    at_least_one = ("limit", "n", "max_new_tokens", "batch_size", "concurrency", "samples_per_request")
    for key in at_least_one:
        value = getattr(args, key, None)
        if value is not None and value < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {value}")
    if args.greedy and args.n not in (None, 1):
        raise ValueError(f"--greedy is deterministic: it takes --n 1, got --n {args.n}")
    checks = (
        ("--temperature", args.temperature, lambda v: args.greedy or (math.isfinite(v) and v > 0), "> 0"),
        ("--top-p", args.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
        (
            "--request-timeout",
            getattr(args, "request_timeout", None),
            lambda v: math.isfinite(v) and v > 0,
            "> 0",
        ),
        ("--retries", getattr(args, "retries", None), lambda v: v >= 0, ">= 0"),
    )
    for flag, value, ok, expected in checks:
        if value is not None and not ok(value):
            raise ValueError(f"{flag} must be {expected}, got {value}")


def _resolve(args: argparse.Namespace) -> None:
    """Fill the protocol flags: explicit flag > preset > default."""
    preset = PRESETS[args.preset] if args.preset else None
    args.budget_from = (
        "--max-new-tokens"
        if args.max_new_tokens is not None
        else f"--preset {args.preset}'s"
        if preset
        else "the default"
    )
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, getattr(preset, key) if preset else default)
    if preset and args.task != preset.task:
        raise ValueError(f"--preset {args.preset} is a {preset.task} benchmark, not --task {args.task}")
    if preset and not args.data:
        raise ValueError(
            f"--preset {args.preset} needs --data: your local copy of its problems "
            f"(docs/EVAL_EXPORT.md says where to get it)"
        )
    _check_numbers(args)  # refused by flag, before any folder is written
    check_server_flags(args)
    resolve_device(args.device)  # a device this machine lacks is refused before anything loads
    if args.no_system_prompt:
        args.system_prompt = None
    elif args.system_prompt is None:
        args.system_prompt = SYSTEM_PROMPT
    args.think_prefix = (
        "" if args.no_think_prefix else THINK_PREFIX if args.think_prefix is None else args.think_prefix
    )


def _settings(
    args: argparse.Namespace,
    engine: str,
    precision: str,
    extra_body: dict[str, Any],
    dtype: str | None = None,
) -> dict[str, Any]:
    """What the samples depend on: a resumed run must match these (``completions.CompletionLog``);
    ``dtype``: the dtype an engine serves in where its preflight says one (vllm; absent for the other
    engines: their folders resume)."""
    return {
        "engine": engine,
        "model": str(args.model),
        "precision": precision,
        "task": args.task,
        "system_prompt": args.system_prompt,
        "think_prefix": args.think_prefix,
        "greedy": args.greedy,
        "temperature": None if args.greedy else args.temperature,
        "top_p": None if args.greedy else args.top_p,
        "max_new_tokens": args.max_new_tokens,
        "extra_body": extra_body,
        **({"beyond_context": True} if args.beyond_context else {}),  # absent by default: old folders resume
        **({"dtype": dtype} if dtype else {}),
    }


def _expected_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """The settings the engine will report, from the flags alone (before any weights are read; with
    --precision recipe every converted layer runs --recipe, the conversion checked on the meta device);
    None where only the built engine knows its precision (one registered by name)."""
    if args.engine == "server":
        return _settings(args, args.engine, ServerEngine.label, parse_extra_body(args))
    if args.preview is None:  # an engine without a preflight: its label is known when it is built
        return None
    return _settings(args, args.engine, args.preview.label, {}, args.preview.served_dtype)


def run(args: argparse.Namespace) -> int:
    from ..generation import ServerError

    if args.perplexity and args.engine != "builtin":
        raise ValueError("--perplexity runs the model in this process: use --engine builtin")
    check_mode_flags(args)
    check_engine_flags(args)
    check_recipe(args)
    if args.perplexity:
        from .perplexity import check_loss_inputs

        check_model_folder(args.model)
        if args.precision == "recipe":
            check_experts(args.model, args.recipe, "--recipe")  # the conversion, on the meta device
        _check_out(Path(args.out))
        rows, positions = config_limits(args.model)  # the windows checked before any weights are read
        check_loss_inputs(args.perplexity, args.split, args.seq_len, args.max_windows, rows, positions)
        return _run_perplexity(load_model(args), args, Path(args.out))
    _resolve(args)
    try:
        return _run_benchmark(args)
    except ServerError as e:
        print(f"infir2 eval: error: {e}", file=sys.stderr, flush=True)
        return 1


def _sample_and_grade(args: argparse.Namespace, problems: list, cfg: Any, out: Path) -> Any:
    """The engine of ``args`` over ``problems`` into ``out``'s completions log (resumed), graded."""
    from ..generation import ServerError

    if args.engine != "server":  # the model folder is named before the tokenizer read from it
        check_model_folder(args.model)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    _preflight(
        args, tokenizer, render_prompts(tokenizer, problems, args.system_prompt, args.think_prefix), out
    )
    top = next((p for p in (out, *out.parents) if p.parent.exists()), out)  # the top folder made here
    created = None if top.exists() else top
    try:
        make_out_dir(out)  # a folder that cannot be made is said before the weights are read
        engine = build_eval_engine(args, tokenizer)  # an in-process engine reads the weights here
        if getattr(engine, "model", None) is not None:  # the loaded embedding, where config.json did not say
            check_vocabulary(engine.model, tokenizer, args.tokenizer or args.model)
        dtype = getattr(engine, "served_dtype", None) if args.preview and args.preview.served_dtype else None
        settings = _settings(args, engine.name, engine.label, getattr(engine, "extra_body", {}), dtype)
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
                args.task,
                args.n,
                cfg,
                args.system_prompt,
                args.think_prefix,
                log=completions,
                seed=args.seed,
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


def _preflight(args: argparse.Namespace, tokenizer, prompts: dict[str, str], out: Path) -> None:
    """Every refusal that needs no weights, before any are read: --out (a folder, or one that can be
    made, and writable), the samples saved there (drawn with these settings and prompts), and for an
    in-process engine the model's config.json (the tokenizer fits its embedding, the prompts and
    --max-new-tokens its positions). Writes nothing."""
    _check_out(out)
    expected = _expected_settings(args)
    if expected is not None and out.is_dir():
        saved = read_saved(out, expected)
        check_prompts(out / COMPLETIONS_FILE, saved.prompts, prompts)
    traits = ENGINES[args.engine].traits
    if traits is None or not traits.in_process:
        return
    rows, positions = config_limits(args.model)
    check_vocabulary_rows(rows, tokenizer, args.tokenizer or args.model)
    if args.precision == "recipe":
        check_experts(args.model, args.recipe, "--recipe")  # the conversion, on the meta device
    longest = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts.values())
    check_prompt_fits(longest, positions, args.beyond_context)
    _check_budget(args, positions)


def _check_budget(args: argparse.Namespace, positions: int | None) -> None:
    """A --max-new-tokens past the model's positions (without --beyond-context) is refused when asked
    for, and said in one warning line when it is the default's or a preset's (each sample stops there)."""
    if positions is None or args.beyond_context or args.max_new_tokens <= positions:
        return
    if args.budget_from == "--max-new-tokens":
        raise ValueError(
            f"--max-new-tokens {args.max_new_tokens} is more than the model's {positions} positions "
            f"(max_position_embeddings in {Path(args.model) / 'config.json'}): a sample stops there "
            f"whatever the budget; give at most {positions}, or --beyond-context to run past them"
        )
    log.warning(
        "--max-new-tokens %d (%s) is more than the model's %d positions: each sample stops where prompt and "
        "response reach %d tokens (--beyond-context runs past them)",
        args.max_new_tokens,
        args.budget_from,
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


def _run_benchmark(args: argparse.Namespace) -> int:
    from ..generation import SamplingConfig
    from ..tasks import load_problems

    out = Path(args.out)
    data = Path(args.data) if args.data else sample_path(args.task)
    problems = load_problems(data, args.task)[: args.limit]
    if args.preset and args.limit is None and len(problems) != PRESETS[args.preset].problems:
        log.warning(
            "%s holds %d problems; the public %s set has %d",
            data,
            len(problems),
            args.preset,
            PRESETS[args.preset].problems,
        )
    cfg = SamplingConfig(
        greedy=args.greedy,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        beyond_context=args.beyond_context,
    )
    result = _sample_and_grade(args, problems, cfg, out)
    result.summary = {"model": str(args.model), "data": str(data), **result.summary}
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
            args.max_new_tokens,
        )
    print(f"results: {out}/samples.jsonl, {out}/problems.jsonl, {out}/summary.md")
    return 0


def _run_perplexity(model, args: argparse.Namespace, out: Path) -> int:
    from ..generation import apply_precision
    from .perplexity import evaluate_loss

    apply_precision(model, args.precision, args.recipe, args.scale_encoding)

    result = evaluate_loss(
        model,
        args.perplexity,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        max_windows=args.max_windows,
        split=args.split,
        fp8=args.precision == "recipe",
    )
    summary = {
        "model": str(args.model),
        "tokens_dir": str(args.perplexity),
        "split": args.split,
        "seq_len": args.seq_len,
        **result.as_dict(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(
        f"loss {result.loss:.4f}  perplexity {result.perplexity:.3f}  over {result.tokens} tokens -> {out}/loss.json"
    )
    return 0
