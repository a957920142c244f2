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
benchmark shipped with infir2 is used. FP8 is off during local evaluation unless --fp8: `--fp8`
(or `--fp8 served`) runs the model as an FP8 serving engine runs its FP8 export (128x128 weights made
by the export's quantizer, 1x128 activations, --scale-encoding pow2 or fp32); `--fp8 RECIPE` converts the
projections with a training recipe (`infir2 config --keys` lists fp8.recipe's names) and runs them in FP8.
--engine takes any engine of the registry (infir2.generation.ENGINES): local, server, or one registered
by name.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

from ..data.chat import SYSTEM_PROMPT, THINK_PREFIX
from ..data.tokenizer import load_tokenizer
from ..fp8 import recipe_names
from ..generation import ENGINES
from ..model import check_model_folder, check_vocabulary, resolve_device
from .presets import PRESETS
from .tasks import TASKS, sample_path

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
        help="local engine: run past the model's max_position_embeddings (RoPE extrapolation, on purpose); "
        "by default a longer prompt is refused and each sample stops at the model's positions (truncated)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"generation budget per sample, unless a preset sets it (default: {DEFAULT_MAX_NEW_TOKENS}); reasoning traces need "
        "tens of thousands, generation stops earlier at the end-of-turn token, and samples cut "
        "here are counted as truncated (with a warning)",
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
        default="local",
        help="local: the built-in KV-cache engine in this process; server: an OpenAI-compatible "
        "/v1/completions endpoint (vLLM, SGLang, transformers serve); or an engine registered by name",
    )
    _add_engine_arguments(p)
    g = p.add_argument_group("held-out loss (instead of a benchmark)")
    g.add_argument("--perplexity", metavar="TOKEN_DIR", help="folder with val.bin + meta.json")
    g.add_argument("--split", default="val", help="token file name without .bin (default: val)")
    g.add_argument("--seq-len", type=int, default=1024, help="context per window (default 1024)")
    g.add_argument("--max-windows", type=int, help="score only the first N windows")


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the built-in (local) engine and of the server engine."""
    g = p.add_argument_group("local engine")
    g.add_argument("--batch-size", type=int, default=8, help="sequences generated together")
    g.add_argument(
        "--fp8",
        nargs="?",
        const="served",
        metavar="served|RECIPE",
        help="run the projections in FP8: 'served' (the default of a bare --fp8) as a serving engine runs "
        "the FP8 export, or a training recipe's name (e.g. blockwise)",
    )
    g.add_argument(
        "--scale-encoding",
        choices=["pow2", "fp32"],
        default="pow2",
        help="--fp8 served: the export's block scales (as `infir2 export --scale-encoding`; default pow2)",
    )
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    s = p.add_argument_group("server engine")
    s.add_argument("--base-url", help="the server, e.g. http://127.0.0.1:8000 (the /v1 is added)")
    s.add_argument("--concurrency", type=int, default=8, help="requests in flight (the server batches them)")
    s.add_argument("--request-timeout", type=float, default=3600.0, help="seconds one request may take")
    s.add_argument(
        "--retries",
        type=int,
        default=8,
        help="retries of a request after a connection error, timeout, 429 or 5xx (backoff 1, 2, 4 "
        "... s, at most 60)",
    )
    s.add_argument(
        "--samples-per-request",
        type=int,
        help="samples asked for in one request (the API's n; default: all of a problem's)",
    )
    s.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    s.add_argument(
        "--extra-body",
        default="{}",
        help="JSON merged into every request, for engine extensions, e.g. '{\"top_k\": -1}' (default: {})",
    )


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
    resolve_device(args.device)  # a device this machine lacks is refused before anything loads
    if args.fp8 not in (None, "served"):
        recipe_names(args.fp8, "--fp8")  # a recipe name, checked by get_recipe
    if args.no_system_prompt:
        args.system_prompt = None
    elif args.system_prompt is None:
        args.system_prompt = SYSTEM_PROMPT
    args.think_prefix = (
        "" if args.no_think_prefix else THINK_PREFIX if args.think_prefix is None else args.think_prefix
    )


def _load(args: argparse.Namespace):
    """The model of --model; with --fp8 RECIPE its projections converted to ``Fp8Linear``."""
    from ..export import load_checkpoint

    device = str(resolve_device(args.device))
    model = load_checkpoint(args.model, device=device)
    if args.fp8 not in (None, "served"):
        from ..nn import convert_to_fp8

        convert_to_fp8(model, args.fp8)  # an unknown recipe name is a ValueError naming the choices
    return model


def _precision(args: argparse.Namespace) -> str:
    return "high" if args.fp8 is None else "served" if args.fp8 == "served" else "fp8"


def _settings(args: argparse.Namespace, engine) -> dict[str, Any]:
    """What the samples depend on: a resumed run must match these (``completions.CompletionLog``)."""
    return {
        "engine": engine.name,
        "model": str(args.model),
        "precision": engine.precision,
        "task": args.task,
        "system_prompt": args.system_prompt,
        "think_prefix": args.think_prefix,
        "greedy": args.greedy,
        "temperature": None if args.greedy else args.temperature,
        "top_p": None if args.greedy else args.top_p,
        "max_new_tokens": args.max_new_tokens,
        "extra_body": getattr(engine, "extra_body", {}),
        **({"beyond_context": True} if args.beyond_context else {}),  # absent by default: old folders resume
    }


def _engine(args: argparse.Namespace, tokenizer):
    from ..generation import EngineOptions, build_engine

    options = EngineOptions(
        tokenizer,
        model=lambda: _load(args),
        precision=_precision(args),
        scale_encoding=args.scale_encoding,
        server=_server_config(args) if args.base_url else None,
    )
    return build_engine(args.engine, options)


def _check_engine_flags(args: argparse.Namespace) -> None:
    """The server engine's flags, before anything is loaded."""
    if args.engine != "server":
        if args.base_url and args.engine == "local":
            raise ValueError("--base-url is for --engine server")
        return
    if not args.base_url:
        raise ValueError("--engine server needs --base-url (e.g. http://127.0.0.1:8000)")
    if args.fp8:
        raise ValueError("--fp8 is for the local engine (a server runs the precision it loaded)")
    if args.tokenizer is None and not Path(args.model).is_dir():
        raise ValueError(
            f"--engine server needs --tokenizer FOLDER to render the prompts (--model {args.model!r} "
            f"is the served name, not a folder)"
        )


def _server_config(args: argparse.Namespace):
    from ..generation import ServerConfig

    try:
        extra = json.loads(args.extra_body)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body is not JSON ({e.msg}): {args.extra_body!r}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {args.extra_body!r}")
    return ServerConfig(
        args.base_url,
        args.model,
        concurrency=args.concurrency,
        timeout_s=args.request_timeout,
        retries=args.retries,
        samples_per_request=args.samples_per_request,
        api_key=args.api_key,
        extra_body=extra,
    )


def run(args: argparse.Namespace) -> int:
    from ..generation import ServerError

    if args.perplexity:
        if args.engine != "local":
            raise ValueError("--perplexity runs the model in this process: use --engine local")
        return _run_perplexity(_load(args), args, Path(args.out))
    _resolve(args)
    try:
        return _run_benchmark(args)
    except ServerError as e:
        print(f"infir2 eval: error: {e}", file=sys.stderr, flush=True)
        return 1


def _sample_and_grade(args: argparse.Namespace, problems: list, cfg: Any, out: Path) -> Any:
    """The engine of ``args`` over ``problems`` into ``out``'s completions log (resumed), graded."""
    from ..generation import ServerError
    from .completions import CompletionLog
    from .runner import run_evaluation

    if args.engine != "server":  # the model folder is named before the tokenizer read from it
        check_model_folder(args.model)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    engine = _engine(args, tokenizer)
    if getattr(engine, "model", None) is not None:  # an in-process engine: every token id has a row
        check_vocabulary(engine.model, tokenizer, args.tokenizer or args.model)
    top = next((p for p in (out, *out.parents) if p.parent.exists()), out)  # the top folder made here
    created = None if top.exists() else top
    with CompletionLog(out, _settings(args, engine)) as completions:
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


def _run_benchmark(args: argparse.Namespace) -> int:
    from ..generation import SamplingConfig
    from .tasks import load_problems

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
        args.greedy,
        args.temperature,
        args.top_p,
        args.max_new_tokens,
        args.batch_size,
        beyond_context=args.beyond_context,
    )
    _check_engine_flags(args)
    result = _sample_and_grade(args, problems, cfg, out)
    result.summary = {"model": str(args.model), "data": str(data), **result.summary}
    result.save(out)
    print(result.markdown(), end="")
    truncated, samples = result.summary.get("truncated", 0), result.summary.get("samples", 0)
    if truncated:
        log.warning(
            "%d of %d samples were cut before finishing, at --max-new-tokens %d or (local engine) at the "
            "model's max_position_embeddings (scored as they stand); raise --max-new-tokens for reasoning "
            "models, or --beyond-context to run past the positions",
            truncated,
            samples,
            args.max_new_tokens,
        )
    print(f"results: {out}/samples.jsonl, {out}/problems.jsonl, {out}/summary.md")
    return 0


def _run_perplexity(model, args: argparse.Namespace, out: Path) -> int:
    from ..generation import serve_fp8
    from .perplexity import evaluate_loss

    if args.fp8 == "served":
        serve_fp8(model, args.scale_encoding)

    result = evaluate_loss(
        model,
        args.perplexity,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        max_windows=args.max_windows,
        split=args.split,
        fp8=_precision(args) == "fp8",
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
