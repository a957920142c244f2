"""Evaluate a checkpoint on a reasoning benchmark (JSONL) or on held-out tokens (loss / perplexity).

Benchmark mode follows the InfiR2 protocol: system prompt "Please reason step by step, and put your
final answer within \\boxed{}.", the assistant turn opened with "<think>\\n", sampling at temperature
0.65 / top-p 0.95, N samples per problem, the answer taken from the last \\boxed{} after </think>.
It writes samples.jsonl (one line per sample), problems.jsonl (per problem), summary.json and
summary.md (avg@n, pass@k, unparseable and truncated counts) under --out.

  infir2 eval --model runs/qwen2.5-7b-sft-stage2/hf --task math --data aime24.jsonl --n 32 --max-new-tokens 32768
  infir2 eval --model runs/qwen2.5-7b-sft-stage2/hf --task multiple_choice --data gpqa.jsonl --n 8 --out runs/eval/gpqa
  infir2 eval --model out/fp8 --task math --greedy            # shipped sample benchmark, FP8 export
  infir2 eval --model runs/qwen2.5-7b-cpt/hf --perplexity data/cpt    # loss on data/cpt/val.bin

--model is a Hugging Face folder (BF16/FP32) or an FP8 folder written by `infir2 export` (dequantized
on load). Math items: {"problem", "answer", "id"?}; multiple choice: {"question", "choices", "answer"
letter, "id"?}. Without --data the small sample benchmark shipped with infir2 is used. FP8 is off during
evaluation unless --fp8 (which converts the projections with the blockwise recipe).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from ..data.tokenizer import load_tokenizer
from .tasks import TASKS, sample_path

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "add_arguments", "run", "sample_path"]

DEFAULT_MAX_NEW_TOKENS = 32768  # the InfiR2 evaluation budget (its 32k context): reasoning is long

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="checkpoint folder (HF BF16/FP32, or FP8 from `infir2 export`)"
    )
    p.add_argument("--tokenizer", help="tokenizer folder (default: --model)")
    p.add_argument(
        "--task", choices=list(TASKS), default="math", help="answer format (a task of the registry)"
    )
    p.add_argument("--data", help="benchmark JSONL (default: the shipped sample for --task)")
    p.add_argument("--n", type=int, default=1, help="samples per problem (avg@n, pass@k); default 1")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (requires --n 1)")
    p.add_argument("--temperature", type=float, default=0.65, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help="generation budget per sample; reasoning traces need tens of thousands, generation "
                        "stops earlier at the end-of-turn token, and samples cut here are counted as "
                        "truncated (with a warning)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=8, help="sequences generated together")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--limit", type=int, help="only the first LIMIT problems")
    p.add_argument("--fp8", action="store_true", help="run the projections in FP8 (blockwise recipe)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--out", default="eval_out", help="output folder (default: eval_out)")
    g = p.add_argument_group("held-out loss (instead of a benchmark)")
    g.add_argument("--perplexity", metavar="TOKEN_DIR", help="folder with val.bin + meta.json")
    g.add_argument("--split", default="val", help="token file name without .bin (default: val)")
    g.add_argument("--seq-len", type=int, default=1024, help="context per window (default 1024)")
    g.add_argument("--max-windows", type=int, help="score only the first N windows")


def _load(args: argparse.Namespace):
    from ..export import load_checkpoint

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_checkpoint(args.model, device=device)
    if args.fp8:
        from ..nn import convert_to_fp8

        convert_to_fp8(model, "blockwise")
    return model


def run(args: argparse.Namespace) -> int:
    model = _load(args)
    out = Path(args.out)
    if args.perplexity:
        return _run_perplexity(model, args, out)
    from .runner import evaluate
    from .tasks import load_problems

    tokenizer = load_tokenizer(args.tokenizer or args.model)
    data = Path(args.data) if args.data else sample_path(args.task)
    problems = load_problems(data, args.task)[: args.limit]
    result = evaluate(model, tokenizer, problems, task=args.task, n=args.n, greedy=args.greedy,
                      temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                      batch_size=args.batch_size, fp8=args.fp8, seed=args.seed)  # fmt: skip
    result.summary = {"model": str(args.model), "data": str(data), **result.summary}
    result.save(out)
    print(result.markdown(), end="")
    truncated, samples = result.summary.get("truncated", 0), result.summary.get("samples", 0)
    if truncated:
        log.warning("%d of %d samples were cut at --max-new-tokens %d before finishing (scored as they stand); "
                    "raise --max-new-tokens for reasoning models", truncated, samples, args.max_new_tokens)  # fmt: skip
    print(f"results: {out}/samples.jsonl, {out}/problems.jsonl, {out}/summary.md")
    return 0


def _run_perplexity(model, args: argparse.Namespace, out: Path) -> int:
    from .perplexity import evaluate_loss

    result = evaluate_loss(model, args.perplexity, seq_len=args.seq_len, batch_size=args.batch_size,
                           max_windows=args.max_windows, split=args.split, fp8=args.fp8)  # fmt: skip
    summary = {"model": str(args.model), "tokens_dir": str(args.perplexity), "split": args.split,
               "seq_len": args.seq_len, **result.as_dict()}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(
        f"loss {result.loss:.4f}  perplexity {result.perplexity:.3f}  over {result.tokens} tokens -> {out}/loss.json"
    )
    return 0
