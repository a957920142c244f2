"""Step time of one decoder layer at the Qwen2.5-0.5B width: the weight kept as FP8 codes (each GEMM
decodes it) vs its fp32 copy kept all step (the CPU emulation before), interleaved, best of N.

One Qwen2 decoder layer (hidden 896, intermediate 4864, 14 / 2 heads), FP8 blockwise on the CPU
backend (``fast_emulated``), forward + backward of ``--micro`` micro-batches of ``--tokens`` tokens
inside one ``cache_fp8_weights`` block (the weights quantized once, as a training step does), fp32.

    PYTHONPATH=src python benchmarks/weight_decode_cost.py --tokens 1024 --micro 2 --repeats 5
"""

from __future__ import annotations

import argparse
import time

import torch

from infir2.kernels import fast_emulated
from infir2.kernels.registry import BACKENDS
from infir2.nn import cache_fp8_weights, convert_to_fp8, recompute_swiglu
from infir2.tools.memory import build_layer

SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2}
QUANTIZERS = {"codes": fast_emulated.quantize, "kept fp32 copy": fast_emulated.quantize_kept_operand}


def step(layer, rotary, tokens: int, micro: int) -> float:
    x = torch.randn(1, tokens, SHAPE["hidden_size"])
    positions = torch.arange(tokens)[None]
    t0 = time.perf_counter()
    with cache_fp8_weights(layer):
        for _ in range(micro):
            inp = x.clone().requires_grad_()
            out = layer(inp, position_embeddings=rotary(inp, positions), position_ids=positions)
            (out[0] if isinstance(out, tuple) else out).sum().backward()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    layer, rotary = build_layer("", **SHAPE)
    recompute_swiglu(layer)
    convert_to_fp8(layer, "blockwise", module_filter_fn=lambda m, _fqn: isinstance(m, torch.nn.Linear))
    best = dict.fromkeys(QUANTIZERS, float("inf"))
    for _ in range(args.repeats):
        for name, quantize in QUANTIZERS.items():
            BACKENDS["fast_emulated"].quantize = quantize  # type: ignore[method-assign]
            best[name] = min(best[name], step(layer, rotary, args.tokens, args.micro))
    BACKENDS["fast_emulated"].quantize = fast_emulated.quantize  # type: ignore[method-assign]
    print(f"one layer, {args.micro} x {args.tokens} tokens, best of {args.repeats}")
    for name, seconds in best.items():
        print(f"  weight as {name:<16} {seconds:7.3f} s  ({seconds / best['kept fp32 copy']:.3f}x)")


if __name__ == "__main__":
    main()
