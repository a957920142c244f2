"""The exact sampler's cost (``rollout.exact``, ``infir2.nn.exact``) against today's, on the showcase setting.

    python benchmarks/exact_sampler.py                       # the demo's RL shape, a random-weight model
    python benchmarks/exact_sampler.py --model runs/demo/runs/bf16/s0/sft/hf   # the demo's SFT model

The showcase is `infir2 demo --rl`'s rollout step: the demo's model shape (Qwen2, hidden 128, 2 layers, 8
heads / 4 KV heads, MLP 256, vocab 400, tied embeddings), 32 prompts x 8 samples at temperature 1, up to
64 new tokens, 128 sequences generated together (``rollout.batch_size``). Per precision pair -- the
identical pairs: ``fp8`` rollouts with ``blockwise`` training and fp32 base dtype, ``high`` rollouts with
``bf16`` (no FP8) training -- the built-in engine generates with today's sampler and with the exact one
(``--repeats`` times each, alternating, the median kept), then the trainer scores the responses
(``response_logprobs``, micro-batches of 64) with its default and its exact numerics. Printed: the
generation and scoring times and their ratios (exact / default), the tokens generated, and for each
sampler the share of its tokens whose log-probability equals the trainer's bit for bit (the trainer of
the same numerics: exact with exact). Also printed, the probe the design rests on: whether an fp32
GEMM's row depends on how many rows it is computed with.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny model builder and tokenizer of the test suite

from conftest import make_tiny_model, make_tokenizer  # noqa: E402
from infir2.generation import BuiltinEngine, RolloutEngine, SamplingConfig  # noqa: E402
from infir2.model import prepare_for_training  # noqa: E402
from infir2.nn.exact import use_exact_numerics  # noqa: E402
from infir2.rl.batch import RLBatch  # noqa: E402
from infir2.rl.update import response_logprobs  # noqa: E402
from infir2.tools.machine import cpu_description  # noqa: E402

PAIRS = {"fp8": "blockwise", "high": "bf16"}  # rollout precision -> the training recipe of its identical pair


def gemm_probe() -> str:
    """Rows of an fp32 GEMM computed with M rows against the same rows of one 512-row GEMM: equal or not."""
    torch.manual_seed(0)
    w, x = torch.randn(384, 128), torch.randn(512, 128)
    full = x @ w.t()
    same = {m: torch.equal(x[8 : 8 + m] @ w.t(), full[8 : 8 + m]) for m in (1, 2, 3, 4, 5, 8, 64)}
    return ", ".join(f"M={m}: {'same' if ok else 'differs'}" for m, ok in same.items())


def showcase_model(path: str | None) -> torch.nn.Module:
    """The demo's model shape (``tools.demo.pipeline``'s config), random weights of seed 0; or ``path``."""
    if path:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path).float()
    shape = dict(hidden=128, layers=2, intermediate=256, heads=8, kv_heads=4, max_positions=128, tie=True)
    return make_tiny_model("qwen2", vocab_size=400, seed=0, **shape)


def prompts_for(tok, n: int, vocab: int) -> list[list[int]]:
    """``n`` arithmetic prompts of the demo's form (its tokenizer when given, else the tests')."""
    out = []
    for i in range(n):
        text = f"Solve step by step. Compute {i % 9 + 1} + {(3 * i) % 9 + 1} - {(5 * i) % 7 + 1}. Answer:"
        out.append([t % vocab for t in tok(text, add_special_tokens=False)["input_ids"]])
    return out


def measure(args, rollout: str, tok) -> dict[str, float]:
    recipe = PAIRS[rollout]
    vocab = showcase_model(args.model).config.vocab_size
    prompts = prompts_for(tok, args.prompts, vocab)
    sampling = SamplingConfig(
        greedy=False,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
    )
    policies, engines = {}, {}
    for exact in (False, True):
        policy = prepare_for_training(showcase_model(args.model), recipe)
        if exact:
            use_exact_numerics(policy)
        builtin = BuiltinEngine(
            policy,
            tok,
            precision=rollout,
            scale_encoding="pow2",
            model_precision="fp32",
            copy_model=True,
            exact=exact,
        )
        policies[exact], engines[exact] = policy, RolloutEngine(builtin, sampling)
    times: dict[bool, list[float]] = {False: [], True: []}
    groups = {}
    for _ in range(args.repeats):
        for exact in (False, True):
            t0 = time.perf_counter()
            groups[exact] = engines[exact].generate(prompts, args.samples, seed=args.seed)
            times[exact].append(time.perf_counter() - t0)
    out: dict[str, float] = {}
    for exact in (False, True):
        key = "exact" if exact else "default"
        out[f"{key}_generate_s"] = statistics.median(times[exact])
        flat = [(prompts[i], r) for i, g in enumerate(groups[exact]) for r in g]
        equal, total, score = 0, 0, 0.0
        with torch.no_grad():
            for start in range(0, len(flat), 64):
                chunk = flat[start : start + 64]
                batch = RLBatch.of_responses([p for p, _ in chunk], [r.response_ids for _, r in chunk], 0)
                t0 = time.perf_counter()
                logp, _ = response_logprobs(policies[exact], batch.rows(list(range(len(batch)))), 1.0, "fp32")
                score += time.perf_counter() - t0
                for i, (_, r) in enumerate(chunk):
                    n = len(r.logprobs)
                    equal += int((logp[i, :n] == torch.tensor(r.logprobs)).sum())
                    total += n
        out[f"{key}_score_s"], out[f"{key}_tokens"], out[f"{key}_equal"] = score, total, equal / max(total, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="an HF folder (the demo's SFT hf/); default: random weights")
    p.add_argument("--pairs", default="fp8,high", help="rollout precisions: fp8 (blockwise), high (bf16)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    pairs = [w.strip() for w in args.pairs.split(",")]
    if "" in pairs or any(w not in PAIRS for w in pairs) or len(set(pairs)) != len(pairs):
        p.error(f"--pairs: each of {', '.join(PAIRS)} at most once, comma-separated; got {args.pairs!r}")
    torch.set_num_threads(1)  # exact numerics are measured at one intra-op thread (nn.exact)
    tok = make_tokenizer(400)
    if args.model:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
    print(f"CPU: {cpu_description()}; torch {torch.__version__}; threads {torch.get_num_threads()}")
    print(f"fp32 GEMM [M,128] @ [128,384], a row against the same row of M=512: {gemm_probe()}")
    print(
        "| rollout:training | tokens default / exact | generate default / exact s | generate ratio | "
        "score default / exact s | score ratio | tokens equal to the trainer's: default / exact |"
    )
    print("|---|---|---|---|---|---|---|")
    for rollout in pairs:
        m = measure(args, rollout, tok)
        print(
            f"| {rollout}:{PAIRS[rollout]} | {m['default_tokens']:.0f} / {m['exact_tokens']:.0f} | "
            f"{m['default_generate_s']:.2f} / {m['exact_generate_s']:.2f} | "
            f"{m['exact_generate_s'] / m['default_generate_s']:.3f} | "
            f"{m['default_score_s']:.2f} / {m['exact_score_s']:.2f} | "
            f"{m['exact_score_s'] / m['default_score_s']:.3f} | "
            f"{100 * m['default_equal']:.1f}% / {100 * m['exact_equal']:.1f}% |",
            flush=True,
        )


if __name__ == "__main__":
    main()
