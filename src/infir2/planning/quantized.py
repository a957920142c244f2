"""The bytes of a quantized operand, from its cast (``fp8.recipe.Cast``): what the plan counts for the
weights FSDP2 gathers as FP8 codes, the rollout engine's FP8 copy and the experts' copies of routed rows.

An FP8 cast keeps 1 byte per element and one scale per block (fp32 / pow2: 4 bytes, E8M0: 1 byte); an
NVFP4 cast (``e2m1``: ``nvfp4``, ``nvfp4_4over6``) keeps two E2M1 codes a byte (0.5 byte per element),
one E4M3 scale (1 byte) per block (16x16 for weights, 1x16 for activations) and one fp32 scale per
tensor. A block dimension of -1 is the whole dimension (one scale per row, column or tensor).
"""

from __future__ import annotations

from ..fp8.recipe import Cast
from .shape import ModelShape

__all__ = ["layer_weight_bytes", "matrix_bytes", "row_bytes"]


def matrix_bytes(rows: int, cols: int, cast: Cast) -> float:
    """Bytes of a ``[rows, cols]`` matrix quantized by ``cast``: codes, block scales and (NVFP4) the
    per-tensor fp32 scale."""
    bm, bk = (rows if cast.block[0] < 0 else cast.block[0]), (cols if cast.block[1] < 0 else cast.block[1])
    blocks = -(-rows // bm) * -(-cols // bk)
    return rows * cols * cast.code_bytes + blocks * cast.block_scale_bytes + cast.tensor_scale_bytes


def layer_weight_bytes(shape: ModelShape, cast: Cast) -> float:
    """Bytes of one layer's projection weights (every expert's) quantized by ``cast``."""
    return sum(count * matrix_bytes(n, k, cast) for n, k, count in shape.projection_matrices)


def row_bytes(cast: Cast, width: int) -> float:
    """Bytes per token of a ``[tokens, width]`` activation quantized by ``cast`` (block rows along
    tokens; a block over all tokens counts no scale per token)."""
    bk = width if cast.block[1] < 0 else cast.block[1]
    scales = 0.0 if cast.block[0] < 0 else -(-width // bk) / cast.block[0]
    return width * cast.code_bytes + scales * cast.block_scale_bytes
