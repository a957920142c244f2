"""The emulated backend: dequantize to fp32 and multiply. Exact, portable, the reference.

Every product of two E4M3 values with power-of-two scales is exact in fp32, so this backend differs
from a hardware FP8 GEMM only by the order of fp32 accumulation. It runs on any device, any cast and
any shape (the registry's defaults say so: available everywhere, every job
taken), ends every fallback chain, and every other backend is tested against it.
"""

from __future__ import annotations

import torch

from ..fp8.nvfp4 import hadamard_transform, quantize_nvfp4
from ..fp8.quantize import quantize as reference_quantize
from ..fp8.recipe import Cast
from .operand import Nvfp4Operand, Operand

__all__ = ["NAME", "gemm_nt", "quantize"]

NAME = "emulated"


def quantize(x: torch.Tensor, cast: Cast) -> Operand:
    if cast.is_fp4:  # NVFP4: the random Hadamard transform along tokens first where the cast asks
        src = hadamard_transform(x) if cast.hadamard else x  # [T, K] -> [ceil(T/16)*16, K]
        codes, block_scale_inv, tensor_scale_inv = quantize_nvfp4(
            src, cast.block, cast.rounding, four_over_six=cast.four_over_six
        )
        return Nvfp4Operand(codes, block_scale_inv, cast.block, tensor_scale_inv)
    data, scale_inv = reference_quantize(x, cast.block, cast.fmt, cast.scale_encoding)
    return Operand(data, scale_inv, cast.block)


def gemm_nt(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b[N, K].T -> [M, N]``: fp32 products and accumulation, cast to ``out_dtype``.

    An fp64 ``out_dtype`` accumulates in fp64 (``model.precision: fp64``, the CPU-independent
    reference): the products are exact either way, and fp64 sums them exactly or within 1e-16."""
    assert a.shape[1] == b.shape[1], f"reduction dims differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    return (a.dequantize(acc) @ b.dequantize(acc).t()).to(out_dtype)  # [M,K] @ [K,N] -> [M,N], acc
