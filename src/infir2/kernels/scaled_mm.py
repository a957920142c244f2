"""The ``torch._scaled_mm`` backend: hardware FP8 GEMMs for tensorwise and rowwise scales.

``torch._scaled_mm(a, b, scale_a, scale_b)`` computes ``(a * scale_a) @ (b * scale_b)`` with ``a``
row-major ``[M, K]`` and ``b`` column-major ``[K, N]``. Tensorwise scales are scalars; rowwise scales
are ``[M, 1]`` for ``a`` and ``[1, N]`` for ``b`` (one per row along K). The "scales" it takes are our
``scale_inv`` (they multiply to dequantize). It runs on CPU and on CUDA (SM89+, dims multiple of 16).

Block-scaled GEMMs (``gemm_nt_blockwise``) go through ``torch.nn.functional.scaled_mm`` with
``ScalingType.BlockWise1x128`` / ``BlockWise128x128`` (cuBLASLt ``VEC128_32F`` / ``BLK128x128_32F``),
which PyTorch implements on SM90 only, with cuBLAS >= 12.9. Its layout rules (``A [M, K]`` row-major,
``B [K, N]`` column-major, i.e. our ``b [N, K]`` row-major, transposed)::

    1x128 scales of A     [M, K/128]            strides (1, M)        "outer-dim-major"
    1x128 scales of B     [N, K/128]            strides (1, N)
    128x128 scales of A   [ru4(K/128), M/128]   strides (1, ru4(K/128))   (ru4: round up to 4)
    128x128 scales of B   [ru4(K/128), N/128]   strides (1, ru4(K/128))

The pairs it takes: 1x128 x 128x128 (fprop, dgrad), 128x128 x 1x128, and 1x128 x 1x128 (wgrad).
Fast accumulation is not allowed with block scales (the K-block promotion is the point).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..fp8.formats import BLOCK
from .operand import Operand

__all__ = ["blockwise_unavailable", "gemm_nt", "gemm_nt_blockwise", "supports_blockwise", "supports_operands"]


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


@functools.cache
def blockwise_unavailable(device: torch.device) -> str | None:
    """Why ``gemm_nt_blockwise`` cannot run on ``device`` (None when it can); asked once per device."""
    if device.type != "cuda":
        return "block-scaled scaled_mm needs CUDA"
    if not hasattr(F, "ScalingType"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm block scaling"
    if torch.version.hip is not None:
        return "block-scaled scaled_mm is not available on ROCm"
    major, _ = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"block-scaled scaled_mm needs an SM90 GPU (this is SM{major}x)"
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < (12, 9):
        return f"block-scaled scaled_mm needs CUDA >= 12.9 (torch built with {torch.version.cuda})"
    return None


def _blockwise_kind(op: Operand) -> str | None:
    bm, bk = op.block
    if bk != BLOCK:
        return None
    return {1: "1x128", BLOCK: "128x128"}.get(bm)


def supports_blockwise(a: Operand, b: Operand) -> bool:
    """True for the block pairs and shapes cuBLAS takes: K a multiple of 128, M and N of 16, E4M3."""
    kinds = (_blockwise_kind(a), _blockwise_kind(b))
    if kinds not in (("1x128", "128x128"), ("128x128", "1x128"), ("1x128", "1x128")):
        return False
    m, k = a.shape
    n = b.shape[0]
    e4m3 = a.data.dtype == torch.float8_e4m3fn and b.data.dtype == torch.float8_e4m3fn
    return e4m3 and k == b.shape[1] and k % BLOCK == 0 and m % 16 == 0 and n % 16 == 0


def _blockwise_scale(op: Operand) -> torch.Tensor:
    """``op.scale_inv`` in the layout cuBLAS wants (see the module doc); copies only the small scales."""
    s = op.scale_inv
    if op.block[0] == 1:  # [M, K/128] with strides (1, M)
        return (
            s
            if s.stride(0) == 1 and (s.shape[1] == 1 or s.stride(1) == s.shape[0])
            else s.t().contiguous().t()
        )
    pad = (-s.shape[1]) % 4  # 128x128: [M/128, K/128] -> padded [M/128, ru4(K/128)], transposed
    return F.pad(s, (0, pad)).contiguous().t()


def gemm_nt_blockwise(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b [N, K].T -> [M, N]`` with cuBLAS block-scaled FP8 (SM90, CUDA >= 12.9)."""
    if not supports_blockwise(a, b):
        raise ValueError(f"block-scaled scaled_mm cannot take blocks {a.block} x {b.block} with shapes "
                         f"{tuple(a.shape)} x {tuple(b.shape)}")  # fmt: skip
    kinds = {"1x128": F.ScalingType.BlockWise1x128, "128x128": F.ScalingType.BlockWise128x128}
    mat_a = a.data if a.data.stride(1) == 1 else a.data.contiguous()  # [M,K] row-major
    mat_b = (b.data if b.data.stride(1) == 1 else b.data.contiguous()).t()  # [K,N] column-major
    # [M,K] @ [K,N] -> [M,N], fp32 accumulate promoted per 128-K block
    return F.scaled_mm(
        mat_a, mat_b,
        _blockwise_scale(a), kinds[_blockwise_kind(a)],  # type: ignore[index]
        _blockwise_scale(b), kinds[_blockwise_kind(b)],  # type: ignore[index]
        output_dtype=out_dtype,
    )  # fmt: skip
