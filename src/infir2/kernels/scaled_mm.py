"""The ``torch._scaled_mm`` backend: hardware FP8 GEMMs for tensorwise and rowwise scales.

``torch._scaled_mm(a, b, scale_a, scale_b)`` computes ``(a * scale_a) @ (b * scale_b)`` with ``a``
row-major ``[M, K]`` and ``b`` column-major ``[K, N]``. Tensorwise scales are scalars; rowwise scales
are ``[M, 1]`` for ``a`` and ``[1, N]`` for ``b`` (one per row along K). The "scales" it takes are our
``scale_inv`` (they multiply to dequantize). It runs on CPU and on CUDA (SM89+, dims multiple of 16).
Block-scaled GEMMs are left to other backends (see ``select``).
"""

from __future__ import annotations

import torch

from .operand import Operand

__all__ = ["gemm_nt", "supports_operands"]


def _is_tensorwise(op: Operand) -> bool:
    return op.scale_inv.numel() == 1


def _is_rowwise(op: Operand) -> bool:
    m, k = op.shape
    return op.scale_inv.shape == (m, 1) and op.block[1] >= k


def supports_operands(a: Operand, b: Operand) -> bool:
    both_tensor = _is_tensorwise(a) and _is_tensorwise(b)
    both_row = _is_rowwise(a) and _is_rowwise(b)
    if not (both_tensor or both_row):
        return False
    if a.data.is_cuda:
        k = a.shape[1]
        n = b.shape[0]
        return k % 16 == 0 and n % 16 == 0
    return True


def gemm_nt(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b [N, K].T -> [M, N]`` with fp32 accumulation in the hardware GEMM."""
    if not supports_operands(a, b):
        raise ValueError(f"scaled_mm takes tensorwise or rowwise operands, got blocks {a.block} x {b.block}")
    if _is_tensorwise(a):
        scale_a, scale_b = a.scale_inv.reshape(()), b.scale_inv.reshape(())
    else:
        scale_a, scale_b = a.scale_inv, b.scale_inv.t()  # [M, 1], [1, N]
    # [M,K] row-major @ [K,N] column-major -> [M,N], fp32 accumulate
    return torch._scaled_mm(
        a.data.contiguous(), b.data.contiguous().t(), scale_a, scale_b, out_dtype=out_dtype
    )
