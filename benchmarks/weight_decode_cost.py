"""Step time of one decoder layer at the Qwen2.5-0.5B width: the weight kept as FP8 codes (each GEMM
decodes it) vs its fp32 copy kept all step (the CPU emulation before), interleaved, best of N.

One Qwen2 decoder layer (hidden 896, intermediate 4864, 14 / 2 heads), FP8 blockwise on the CPU
backend (``fast_emulated``), forward + backward of ``--micro`` micro-batches of ``--tokens`` tokens
inside one ``cache_fp8_weights`` block (the weights quantized once, as a training step does), fp32.

    PYTHONPATH=src python benchmarks/weight_decode_cost.py --tokens 1024 --micro 2 --repeats 5
"""

from __future__ import annotations

import time

import torch
from weight_cache_scope import SHAPE, fp8_layer, layer_arguments  # the same layer and flags

from infir2.kernels import fast_emulated
from infir2.kernels.registry import BACKENDS
from infir2.nn import cache_fp8_weights

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
    args = layer_arguments(__doc__)
    torch.set_num_threads(1)
    layer, rotary = fp8_layer()
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
