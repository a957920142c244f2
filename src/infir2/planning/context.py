"""The context-parallel term: what a rank keeps beyond its shard of each sequence.

Under ``--context N`` (``parallel.context``) each GPU keeps the activations and logits of
``seq_len / N`` tokens (``PlanInputs.tokens``), plus each layer's keys and values of the other shards,
gathered and kept for attention's backward (every layer, or one under activation checkpointing).
"""

from __future__ import annotations

from ..fp8.formats import BLOCK
from .inputs import BF16_BYTES, FP32_BYTES, PlanInputs
from .shape import ModelShape

__all__ = ["check_context", "context_kv_bytes", "gathered_kv_bytes"]


def context_kv_bytes(shape: ModelShape, tokens: int, context: int, cpu: bool) -> float:
    """What one layer keeps beyond its shard under context parallelism: the keys and values of the
    other ``context - 1`` shards of ``tokens`` (the whole micro-batch), gathered for attention and saved
    for its backward (fp32 on a CPU, bf16 under autocast)."""
    if context == 1:
        return 0.0
    kv = shape.kv_heads * shape.head_dim
    width = FP32_BYTES if cpu else BF16_BYTES
    return 2 * kv * width * tokens * (context - 1) / context


def gathered_kv_bytes(shape: ModelShape, run: PlanInputs) -> float:
    """The gathered keys and values a rank keeps at the start of backward: every layer's, or the one
    being recomputed under activation checkpointing."""
    kv_layers = 1 if run.activation_checkpointing else shape.layers
    return kv_layers * context_kv_bytes(shape, run.seq_len * run.micro_batch, run.context, run.cpu)


def check_context(context: int, gpus: int, seq_len: int) -> None:
    """``--context``: a divisor of ``--gpus`` whose shards of ``--seq-len`` are whole blocks."""
    if context < 1 or gpus % context:
        raise ValueError(
            f"--context {context}: must be >= 1 and divide --gpus {gpus} (the GPUs are data x context)"
        )
    if context > 1 and seq_len % (context * BLOCK):
        raise ValueError(
            f"--seq-len {seq_len} does not split into --context {context} shards of a multiple of {BLOCK} "
            f"tokens (make it a multiple of {context * BLOCK})"
        )
