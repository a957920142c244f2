"""All-gather bytes per training step under FSDP2: fp32 vs bf16 vs FP8 parameter all-gather.

Run on CPU (gloo) or GPUs (NCCL), 2 processes:

    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_wire_bytes.py

For each mode it builds the same tiny Qwen2 (untied embeddings), shards it with
``infir2.harness.distributed.shard_model``, runs ``--steps`` training steps on random tokens and
counts, on rank 0, the bytes every FSDP2 all-gather delivers to the rank (``WireBytes``, installed
through FSDP2's ``set_custom_all_gather``) and the block-amax all-reduces of the FP8 gather (bytes
and number of collectives: one per FSDP unit and all-gather, latency-bound, so the count matters).
Modes: ``fp32`` (no mixed-precision policy), ``bf16`` (``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``), ``bf16+fp8`` (bf16 policy and ``fp8.param_gather``: FP8 linears' weights
as FP8 codes). Prints bytes per step and the ratios to bf16; the FP8/bf16 ratio depends on the
share of parameters outside the FP8 linears (embeddings, lm_head, norms, biases).
"""

from __future__ import annotations

import argparse

import torch

from infir2.harness.distributed import init_distributed, shard_model
from infir2.harness.optim import build_optimizer
from infir2.model import prepare_for_training
from infir2.tools.wire_bytes import AmaxBytes, WireBytes
from infir2.train.config import OptimConfig
from infir2.train.loop import train_step

MODES = {"fp32": ("fp32", False), "bf16": ("bf16", False), "bf16+fp8": ("bf16", True)}


def tiny_qwen2(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).float()


def measure(mode: str, args: argparse.Namespace, env) -> tuple[float, float, float, int]:
    precision, fp8_gather = MODES[mode]
    model = prepare_for_training(tiny_qwen2(args), "blockwise")
    n_params = sum(p.numel() for p in model.parameters())
    shard_model(model, precision, fp8_gather)
    counter, amax = WireBytes.install(model), AmaxBytes.install()
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    g = torch.Generator().manual_seed(env.rank)
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (1, args.seq_len), generator=g)
        train_step(model, optimizer, [{"input_ids": ids, "labels": ids}], 1e-3, 1.0, precision, env)
    amax.remove()
    return counter.bytes / args.steps, amax.bytes / args.steps, amax.collectives / args.steps, n_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = init_distributed("auto")
    try:
        rows = [(mode, *measure(mode, args, env)) for mode in MODES]
    finally:
        env.close()
    if env.is_main:
        base = rows[1][1]
        print(
            f"FSDP2 all-gather bytes per step and rank, world size {env.world_size}, tiny Qwen2 "
            f"(hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, vocab {args.vocab}, "
            f"{rows[0][4] / 1e6:.2f}M parameters), torch {torch.__version__}"
        )
        print(
            f"{'mode':<10} {'all-gather MB':>14} {'amax all-reduce KB':>19} {'amax all-reduces':>17} "
            f"{'bytes/param':>12} {'ratio to bf16':>14}"
        )
        for mode, wire, amax, collectives, n_params in rows:
            print(
                f"{mode:<10} {wire / 1e6:>14.3f} {amax / 1e3:>19.1f} {collectives:>17.1f} "
                f"{wire / n_params:>12.3f} {wire / base:>14.3f}"
            )


if __name__ == "__main__":
    main()
