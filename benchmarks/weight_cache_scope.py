"""What the ``layer`` weight-cache scope (``fp8.weight_cache``) costs in time against ``step``, on a CPU.

``layer`` quantizes each FP8 weight in every forward (under activation checkpointing also in the
recompute) and frees it after the layer's backward; ``step`` quantizes it once per optimizer step and
keeps every layer's copy for the step. The bytes are identical (``tests/test_weight_cache_scope.py``),
so the only price is the extra quantizations. This script times, for one Qwen2 decoder layer at the
Qwen2.5-0.5B width (FP8 blockwise, fp32, the SwiGLU recompute, activation checkpointing as the trainer
wraps a layer), ``--micro`` micro-batches of ``--tokens`` tokens under each scope, interleaved, best
of ``--repeats``, and the quantization of the layer's seven weights alone; the extra quantizations
``layer`` makes (two per micro-batch, forward and recompute, against one per step) times that figure
is the predicted difference. It also prints the ratio computed for a GPU from bytes and FLOPs (not
measured: no GPU was lent to the session that wrote it).

    PYTHONPATH=src python benchmarks/weight_cache_scope.py --tokens 1024 --micro 2 --repeats 5
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from infir2.nn import Fp8Linear, cache_fp8_weights, convert_to_fp8, recompute_swiglu
from infir2.tools.machine import cpu_description
from infir2.tools.memory import build_layer

SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2}


def step(layer: Any, rotary: Any, tokens: int, micro: int, scope: str) -> float:
    """Seconds of ``micro`` forward + backward passes of the checkpointed layer inside one scope block."""
    x = torch.randn(1, tokens, SHAPE["hidden_size"])
    positions = torch.arange(tokens)[None]

    def run(inp: torch.Tensor) -> torch.Tensor:
        out = layer(inp, position_embeddings=rotary(inp, positions), position_ids=positions)
        return out[0] if isinstance(out, tuple) else out

    t0 = time.perf_counter()
    with cache_fp8_weights(layer, scope):
        for _ in range(micro):
            checkpoint(run, x.clone().requires_grad_(), use_reentrant=False).sum().backward()
    return time.perf_counter() - t0


def quantize_all(layer: Any) -> float:
    """Seconds to quantize the layer's seven FP8 weights once (outside any cache)."""
    linears = [m for m in layer.modules() if isinstance(m, Fp8Linear)]
    t0 = time.perf_counter()
    for m in linears:
        m.quantized_weight()
    return time.perf_counter() - t0


def gpu_estimate(tokens: int, tflops: float, tbps: float) -> float:
    """Computed, per weight element and micro-batch under activation checkpointing: the time of what
    ``layer`` moves that ``step`` does not (two quantizations, forward and recompute, each reading the
    fp32 master once and writing 1 B of codes, and the K-major copy, 1 B read and 1 B written: 12 B;
    BF16's autocast casts move as much, 2 x (4 + 2) B) over the projection GEMMs' time (forward,
    recompute, dgrad, wgrad: 8 x tokens FLOPs), both at the GPU's peak rates."""
    return (12 / (tbps * 1e12)) / (8 * tokens / (tflops * 1e12))


def layer_arguments(doc: str | None) -> argparse.Namespace:
    """The flags of the one-layer timings (this script and ``weight_decode_cost.py``)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def fp8_layer() -> tuple[Any, Any]:
    """One Qwen2 decoder layer at the 0.5B width (``SHAPE``) with the SwiGLU recompute, its linears FP8
    blockwise, and its rotary embedding."""
    layer, rotary = build_layer("", **SHAPE)
    recompute_swiglu(layer)
    convert_to_fp8(layer, "blockwise", module_filter_fn=lambda m, _fqn: isinstance(m, torch.nn.Linear))
    return layer, rotary


def main() -> None:
    args = layer_arguments(__doc__)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer, rotary = fp8_layer()
    layer.train()
    best = {"step": float("inf"), "layer": float("inf")}
    quantize = float("inf")
    for _ in range(args.repeats):
        for scope in best:
            best[scope] = min(best[scope], step(layer, rotary, args.tokens, args.micro, scope))
        quantize = min(quantize, quantize_all(layer))
    extra = 2 * args.micro - 1  # layer: forward + recompute per micro-batch; step: once
    print(f"CPU: {cpu_description()}, 1 thread")
    print(
        f"one layer at the 0.5B width, checkpointed, {args.micro} x {args.tokens} tokens, best of {args.repeats}"
    )
    for scope, seconds in best.items():
        print(f"  fp8.weight_cache: {scope:<6} {seconds:7.3f} s  ({seconds / best['step']:.3f}x)")
    print(f"  quantizing the layer's 7 weights once: {quantize * 1e3:.1f} ms")
    print(
        f"  predicted layer - step: {extra} x {quantize * 1e3:.1f} ms = {extra * quantize:.3f} s "
        f"({extra * quantize / best['step']:.3f} of the step); measured {best['layer'] - best['step']:.3f} s"
    )
    for name, tflops, tbps in (("H100 SXM", 1979.0, 3.35), ("H200", 1979.0, 4.8)):
        ratio = gpu_estimate(8192, tflops, tbps)
        print(
            f"  computed, {name} (dense FP8 {tflops:.0f} TFLOP/s, {tbps} TB/s, both at peak), 8192 tokens, "
            f"checkpointed: layer's quantizations = {ratio:.3f} of the projection GEMMs' time per micro-batch"
        )


if __name__ == "__main__":
    main()
