"""`infir2 eval`'s command line: every flag (``add_arguments``; each engine's own: ``engine_flags``), the
numbers' ranges, and the protocol's defaults (explicit flag > preset > default: ``resolve_protocol``),
what ``builder.eval_config`` turns into the typed config."""

from __future__ import annotations

import argparse
from typing import Any

from ..data.chat import SYSTEM_PROMPT, THINK_PREFIX
from ..generation import ENGINES
from ..model import resolve_device
from ..tasks import TASKS
from .config import DEFAULT_MAX_NEW_TOKENS, EvalBenchmark, EvalSampling, defaults
from .engine_flags import add_engine_arguments, check_server_flags
from .presets import PRESETS

__all__ = ["DEFAULTS", "DEFAULT_MAX_NEW_TOKENS", "add_arguments", "resolve_protocol"]

#: values used when neither the flag nor a preset sets them
DEFAULTS: dict[str, Any] = {
    **defaults(EvalBenchmark, ("task", "n")),
    **defaults(EvalSampling, ("temperature", "top_p", "max_new_tokens")),
}


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


def resolve_protocol(args: argparse.Namespace, checked: bool = True) -> None:
    """Fill the protocol flags: explicit flag > preset > default; ``checked`` (a benchmark): each refused
    by flag, before any folder is written."""
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
    if checked and preset and args.task != preset.task:
        raise ValueError(f"--preset {args.preset} is a {preset.task} benchmark, not --task {args.task}")
    if checked and preset and not args.data:
        raise ValueError(
            f"--preset {args.preset} needs --data: your local copy of its problems "
            f"(docs/EVAL_EXPORT.md says where to get it)"
        )
    if checked:
        _check_numbers(args)
        check_server_flags(args)
    resolve_device(args.device)  # a device this machine lacks is refused before anything loads
    if args.no_system_prompt:
        args.system_prompt = None
    elif args.system_prompt is None:
        args.system_prompt = SYSTEM_PROMPT
    args.think_prefix = (
        "" if args.no_think_prefix else THINK_PREFIX if args.think_prefix is None else args.think_prefix
    )
