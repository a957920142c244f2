"""Rollout-vs-trainer mismatch per precision pair, on the same prompts and weights (`infir2 rl`'s metrics).

    python benchmarks/rl_mismatch.py --model /tmp/rl-demo/runs/bf16/s0/sft/hf --prompts /tmp/rl-demo/data/test.jsonl

For each pair ``ROLLOUT:TRAINING`` (``rollout.precision`` ``high | fp8`` x training recipe): the built-in engine
generates ``--samples`` responses for each of the first ``--n`` prompts (the same seed for every pair,
so the same sampler stream), the trainer computes the log-probabilities of the same tokens with the same
master weights, and the table shows `infir2.rl.mismatch_metrics` over all response tokens: mean and max
|dlogp|, the k3 KL estimate, the token probability error mean(exp(|dlogp|)), the TIS clip fraction and
ESS at cap 2 and, "after TIS", the part of |dlogp| that truncation at the cap leaves uncorrected
(mean of max(dlogp - log 2, 0)): 0 when every ratio is under the cap.

``--base-dtype`` is ``rollout.base_dtype`` for the FP8 rollouts (bf16, ``infir2 rl``'s default: the FP8
export's embeddings / norms / lm_head; fp32: the trainer's, the pair that quantizes identically with
``blockwise``). Beside the metrics: the tokens whose |dlogp| is above 1e-4 and the share exactly equal
(0.0), and the parity probe: the engine's own weights scored by the trainer's full forward
(``response_logprobs`` on the engine's copy, the batches the trainer scores) against the trainer --
``rescore max |d|`` (0 when the engine's weights and kernels compute exactly what the trainer's do) --
with the times of generation, of the trainer's scoring and of that rescoring.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from infir2.data import load_tokenizer
from infir2.data.chat import render_prompt
from infir2.eval import load_problems
from infir2.generation import BuiltinEngine, RolloutEngine, SamplingConfig
from infir2.model import load_pretrained, prepare_for_training
from infir2.rl.algorithm import mismatch_metrics
from infir2.rl.batch import RLBatch
from infir2.rl.update import response_logprobs

PAIRS = "high:bf16,fp8:bf16,high:blockwise,fp8:blockwise,fp8:blockwise_fp32scale"


def measure(
    model_dir: str, prompts: list[list[int]], tok, rollout: str, recipe: str, args
) -> dict[str, float]:
    policy = prepare_for_training(load_pretrained(model_dir), recipe)
    base = {"bf16": torch.bfloat16, "fp32": None}[args.base_dtype]
    builtin = BuiltinEngine(
        policy, tok, precision=rollout, model_precision="fp32", copy_model=True, base_dtype=base
    )
    engine = RolloutEngine(
        builtin, SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, batch_size=64)
    )
    t0 = time.perf_counter()
    groups = engine.generate(prompts, args.samples, seed=args.seed)
    times = {"generate": time.perf_counter() - t0, "score": 0.0, "rescore": 0.0}
    flat = [(prompts[i], r) for i, g in enumerate(groups) for r in g]
    logps, rolls, rescored = [], [], []
    with torch.no_grad():
        for start in range(0, len(flat), 64):
            chunk = flat[start : start + 64]
            batch = RLBatch.of_responses(
                [p for p, _ in chunk], [r.response_ids for _, r in chunk], tok.pad_token_id
            )
            rows = batch.rows(list(range(len(batch))))
            t0 = time.perf_counter()
            logp, _ = response_logprobs(policy, rows, 1.0, "fp32")
            t1 = time.perf_counter()
            again, _ = response_logprobs(builtin.model, rows, 1.0, "fp32")  # the engine's weights
            times["score"] += t1 - t0
            times["rescore"] += time.perf_counter() - t1
            for i, (_, r) in enumerate(chunk):
                logps.append(logp[i, : len(r.logprobs)])
                rescored.append(again[i, : len(r.logprobs)])
                rolls.append(torch.tensor(r.logprobs))
    train, roll = torch.cat(logps), torch.cat(rolls)
    out = mismatch_metrics(train, roll, torch.ones_like(train), cap=2.0)
    d = (train.double() - roll.double()).abs()
    out["after_tis"] = float((d - math.log(2.0)).clamp(min=0).mean())
    out["tokens"] = float(train.numel())
    out["over_1e-4"] = float((d > 1e-4).sum())
    out["equal_frac"] = float((d == 0).double().mean())
    out["rescore_max"] = float((torch.cat(rescored).double() - train.double()).abs().max())
    return out | {f"{k}_s": v for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model folder (e.g. the demo's SFT hf/)")
    p.add_argument("--prompts", required=True, help="JSONL problem/answer")
    p.add_argument("--pairs", default=PAIRS)
    p.add_argument("--n", type=int, default=32, help="prompts")
    p.add_argument("--samples", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--base-dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="FP8 rollouts: rollout.base_dtype (bf16: the FP8 export's, infir2 rl's default; fp32: the trainer's)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    problems = load_problems(args.prompts, "math")[: args.n]
    prompts = [
        tok(render_prompt(tok, q.user_message), add_special_tokens=False)["input_ids"] for q in problems
    ]
    print(
        "| rollout | training | tokens | mean abs dlogp | max abs dlogp | k3 KL | prob error | TIS clip frac | "
        "TIS ESS | abs dlogp left after TIS | tokens abs dlogp > 1e-4 | tokens equal | rescore max abs d | "
        "generate / score / rescore s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for pair in args.pairs.split(","):
        rollout, recipe = pair.split(":")
        m = measure(args.model, prompts, tok, rollout, recipe, args)
        print(
            f"| {rollout} | {recipe} | {m['tokens']:.0f} | {m['mismatch/abs_dlogp_mean']:.2e} | "
            f"{m['mismatch/abs_dlogp_max']:.2e} | {m['mismatch/k3_kl']:.2e} | {m['mismatch/prob_error']:.4f} | "
            f"{m['mismatch/tis_clip_frac']:.4f} | {m['mismatch/tis_ess']:.4f} | {m['after_tis']:.2e} | "
            f"{m['over_1e-4']:.0f} | {m['equal_frac']:.3f} | {m['rescore_max']:.2e} | "
            f"{m['generate_s']:.1f} / {m['score_s']:.2f} / {m['rescore_s']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
