"""The emulated backend: dequantize to fp32 and multiply. Exact, portable, the reference.

Every product of two E4M3 values with power-of-two scales is exact in fp32, so this backend differs
from a hardware FP8 GEMM only by the order of fp32 accumulation. It runs on any device and any
shape, and every other backend is tested against it.
"""

from __future__ import annotations

import torch

from ..fp8.quantize import Block, quantize
from .operand import Operand

__all__ = ["gemm_nt", "quantize_operand"]


def quantize_operand(x: torch.Tensor, block: Block, fmt: str, pow2_scale: bool) -> Operand:
    data, scale_inv = quantize(x, block, fmt, pow2_scale)
    return Operand(data, scale_inv, tuple(block))  # type: ignore[arg-type]


def gemm_nt(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b[N, K].T -> [M, N]``: fp32 products and accumulation, cast to ``out_dtype``."""
    assert a.shape[1] == b.shape[1], f"reduction dims differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a.dequantize() @ b.dequantize().t()).to(out_dtype)  # [M,K] @ [K,N] -> [M,N], fp32
