"""One arm of ``gpu_bench.py``'s vLLM phase: the vllm engine (``rollout.engine: vllm``) on a random model.

    PYTHONPATH=src python3 benchmarks/vllm_bench.py --arm fp8 --device cuda    # one JSON line on stdout

Each arm runs in a process of its own (one ``vllm.LLM`` per process, as ``infir2 rl`` holds one):

* ``high``: ``rollout.precision: high`` served in the trainer's dtype (bfloat16 on CUDA, model.precision
  bf16; float32 on a CPU, model.precision fp32);
* ``fp8``: ``rollout.precision: fp8``: the projections refit as the FP8 export stores them, served in
  bfloat16 (vLLM's block-FP8 linear: AMX on a CPU, refused in one line elsewhere).

Measured: start-up (vLLM built and the first refit), rollout tokens/s (``--prompts`` x ``--samples``
sampled responses at temperature 1, up to ``--new-tokens`` each, one ``generate``), the rollout-vs-trainer
mismatch of those tokens (``rl.mismatch_metrics``: the trainer's fp32 masters scored in the run's
precision), and the refit time per update (``--refits`` refits of perturbed weights, median). A random
Qwen2.5-1.5B-shaped model on CUDA (``--layers`` 28), a tiny one on a CPU: the weights' values do not
change the throughput, and nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

ARMS = ("high", "fp8")


@dataclass(frozen=True)
class VllmSizes:
    """The model and the rollout batch of one arm."""

    hidden: int = 1536  # Qwen2.5-1.5B
    intermediate: int = 8960
    layers: int = 28
    heads: int = 12
    kv_heads: int = 2
    vocab: int = 151936
    prompts: int = 64
    samples: int = 8
    prompt_len: int = 256
    new_tokens: int = 512
    refits: int = 3


GPU_SIZES = VllmSizes()
CPU_SIZES = VllmSizes(256, 512, 2, 2, 1, 512, prompts=4, samples=2, prompt_len=16, new_tokens=16, refits=2)


class _Tokenizer:
    """What the engine reads of a tokenizer (its stop and pad ids): the last id stops, nothing is decoded."""

    def __init__(self, vocab: int) -> None:
        self.eos_token_id = self.pad_token_id = vocab - 1

    def get_vocab(self) -> dict[str, int]:
        return {}


def _policy(sizes: VllmSizes, device: torch.device) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=sizes.vocab,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        max_position_embeddings=sizes.prompt_len + sizes.new_tokens,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).to(device).eval()  # fp32 masters, as the trainer holds them


def _mismatch(policy: torch.nn.Module, prompts: list[list[int]], groups: Any, precision: str) -> dict:
    """The trainer's log-probabilities of the engine's tokens against the engine's own."""
    from infir2.rl.algorithm import mismatch_metrics
    from infir2.rl.batch import RLBatch
    from infir2.rl.update import response_logprobs

    flat = [(prompts[i], r) for i, g in enumerate(groups) for r in g if r.response_ids]
    train, roll = [], []
    with torch.no_grad():
        for start in range(0, len(flat), 16):
            chunk = flat[start : start + 16]
            batch = RLBatch.of_responses([p for p, _ in chunk], [r.response_ids for _, r in chunk], 0)
            logp, _ = response_logprobs(policy, batch.rows(list(range(len(batch)))), 1.0, precision)
            for i, (_, r) in enumerate(chunk):
                train.append(logp[i, : len(r.logprobs)].cpu())
                roll.append(torch.tensor(r.logprobs))
    t, r = torch.cat(train), torch.cat(roll)
    m = mismatch_metrics(t, r, torch.ones_like(t), cap=2.0)
    return {"|dlogp| mean": m["mismatch/abs_dlogp_mean"], "|dlogp| max": m["mismatch/abs_dlogp_max"]}


def run_arm(arm: str, device: torch.device, sizes: VllmSizes) -> dict[str, Any]:
    """One arm's figures (module doc)."""
    from infir2.generation import RolloutEngine, SamplingConfig
    from infir2.generation.vllm_engine import VllmEngine, VllmSettings

    cuda = device.type == "cuda"
    precision = "bf16" if cuda else "fp32"  # model.precision: what the trainer scores in
    policy = _policy(sizes, device)
    settings = VllmSettings(memory_fraction=0.35, max_model_len=sizes.prompt_len + sizes.new_tokens)
    t0 = time.perf_counter()
    engine = VllmEngine(
        _Tokenizer(sizes.vocab), settings, policy=policy, precision=arm, model_precision=precision
    )
    start_s = time.perf_counter() - t0
    rollout = RolloutEngine(
        engine,
        SamplingConfig(
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=sizes.new_tokens,
            batch_size=sizes.prompts * sizes.samples,
        ),
    )
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, sizes.vocab - 1, (sizes.prompts, sizes.prompt_len), generator=gen).tolist()
    t0 = time.perf_counter()
    groups = rollout.generate(prompts, sizes.samples, seed=0)
    gen_s = time.perf_counter() - t0
    tokens = sum(len(r.response_ids) for g in groups for r in g)
    row = {"arm": arm, "dtype": engine.served_dtype, "start s": start_s, "tokens": tokens}
    row |= {"rollout tokens/s": tokens / gen_s, **_mismatch(policy, prompts, groups, precision)}
    refits = []
    for _ in range(sizes.refits):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p), alpha=1e-3)
        engine.load_weights(policy)
        refits.append(engine.refit_s)
    return row | {"refit s (median)": statistics.median(refits)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--arm", choices=ARMS, required=True, help="high (rollout.precision high: bf16 on CUDA) or fp8"
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: tiny shapes")
    p.add_argument("--layers", type=int, help="decoder layers (default: 28 on CUDA, 2 on a CPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "vllm_bench.py: --device cuda: no CUDA device here (--device cpu: tiny shapes)", file=sys.stderr
        )
        return 2
    if args.layers is not None and args.layers < 1:
        print(f"vllm_bench.py: --layers must be >= 1, got {args.layers}", file=sys.stderr)
        return 2
    sizes = GPU_SIZES if device.type == "cuda" else CPU_SIZES
    if args.layers:
        sizes = VllmSizes(**{**asdict(sizes), "layers": args.layers})
    try:
        row = run_arm(args.arm, device, sizes)
    except ValueError as e:  # the engine's one-line refusals (no vLLM, FP8 where vLLM cannot serve it)
        print(json.dumps({"arm": args.arm, "error": str(e)}), flush=True)
        return 1
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
