"""The ``scaled_mm`` backend: PyTorch's own FP8 GEMMs (cuBLAS on CUDA, a reference kernel on CPU).

It quantizes nothing (it has no ``quantize``: the next backend of the chain does) and takes three
kinds of GEMM (never E5M2 x E5M2, which cuBLAS refuses):

* tensorwise and rowwise fp32 scales through ``torch._scaled_mm`` (CPU; CUDA SM89+, dims % 16);
* block-scaled 1x128 / 128x128 fp32 scales through ``torch.nn.functional.scaled_mm`` (CUDA SM90,
  cuBLAS >= 12.9), below.

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
from ..fp8.recipe import Cast, Fp8Recipe
from .operand import Operand

__all__ = [
    "NAME",
    "blockwise_unavailable",
    "gemm_nt",
    "gemm_nt_blockwise",
    "supports_blockwise",
    "supports_gemm",
    "supports_operands",
    "why_unavailable",
]

NAME = "scaled_mm"


def _per_tensor_or_row(cast: Cast) -> bool:
    return cast.scale_encoding != "e8m0" and tuple(cast.block) in ((-1, -1), (1, -1), (-1, 1))


def why_unavailable(recipe: Fp8Recipe, device: torch.device) -> str | None:
    if device.type not in ("cpu", "cuda"):
        return f"torch._scaled_mm does not run on {device.type}"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return "FP8 GEMMs need an SM89+ GPU"
    if not any(_per_tensor_or_row(c) for c in recipe.casts.values()):
        reason = blockwise_unavailable(device)
        if reason:
            return f"recipe {recipe.name!r} has no tensorwise or rowwise cast and {reason}"
    return None


def supports_gemm(a: Operand, b: Operand, out_dtype: torch.dtype) -> bool:
    fp32_scales = a.scale_inv.dtype == torch.float32 and b.scale_inv.dtype == torch.float32
    if not fp32_scales:
        return False
    if supports_operands(a, b):
        return True
    return blockwise_unavailable(a.data.device) is None and supports_blockwise(a, b)


def _is_tensorwise(op: Operand) -> bool:
    return tuple(op.block) == (-1, -1) and op.scale_inv.numel() == 1


def _is_rowwise(op: Operand) -> bool:
    """One scale per row along K: a (1, -1) block (blockwise tiles that happen to span K do not count,
    so that a recipe's GEMMs run on one backend whatever the layer's width)."""
    return tuple(op.block) == (1, -1) and op.scale_inv.shape == (op.shape[0], 1)


def _both_e5m2(a: Operand, b: Operand) -> bool:
    """E5M2 x E5M2: no cuBLAS FP8 GEMM takes it (one operand at least must be E4M3)."""
    return a.data.dtype == torch.float8_e5m2 and b.data.dtype == torch.float8_e5m2


def supports_operands(a: Operand, b: Operand) -> bool:
    both_tensor = _is_tensorwise(a) and _is_tensorwise(b)
    both_row = _is_rowwise(a) and _is_rowwise(b)
    if not (both_tensor or both_row) or _both_e5m2(a, b):
        return False
    if a.data.is_cuda:
        k = a.shape[1]
        n = b.shape[0]
        return k % 16 == 0 and n % 16 == 0
    return True


def gemm_nt(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b [N, K].T -> [M, N]`` with fp32 accumulation in the hardware GEMM."""
    if not supports_operands(a, b) and supports_blockwise(a, b):
        return gemm_nt_blockwise(a, b, out_dtype)
    if not supports_operands(a, b):
        raise ValueError(f"scaled_mm takes tensorwise or rowwise operands, got blocks {a.block} x {b.block}")
    if _is_tensorwise(a):
        scale_a, scale_b = a.scale_inv.reshape(()), b.scale_inv.reshape(())
    else:
        scale_a, scale_b = (
            a.scale_inv.reshape(-1)[:, None],
            b.scale_inv.reshape(1, -1),
        )  # [M, 1], [1, N], unit stride
    # [M,K] row-major @ [K,N] column-major -> [M,N], fp32 accumulate
    return torch._scaled_mm(
        a.data.contiguous(), b.data.contiguous().t(), scale_a, scale_b, out_dtype=out_dtype
    )


@functools.cache
def blockwise_unavailable(device: torch.device) -> str | None:
    """Why ``gemm_nt_blockwise`` cannot run on ``device`` (None when it can); asked once per device."""
    if device.type != "cuda":
        return "block-scaled scaled_mm needs CUDA"
    if not hasattr(F, "scaled_mm") or not all(
        hasattr(getattr(F, "ScalingType", None), kind) for kind in ("BlockWise1x128", "BlockWise128x128")
    ):
        return f"torch {torch.__version__} has no F.scaled_mm with BlockWise1x128 / 128x128 scales"
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
        raise ValueError(
            f"block-scaled scaled_mm cannot take blocks {a.block} x {b.block} with shapes "
            f"{tuple(a.shape)} x {tuple(b.shape)}"
        )
    kinds = {"1x128": F.ScalingType.BlockWise1x128, "128x128": F.ScalingType.BlockWise128x128}
    mat_a = a.data if a.data.stride(1) == 1 else a.data.contiguous()  # [M,K] row-major
    mat_b = (b.data if b.data.stride(1) == 1 else b.data.contiguous()).t()  # [K,N] column-major
    # [M,K] @ [K,N] -> [M,N], fp32 accumulate promoted per 128-K block
    return F.scaled_mm(
        mat_a,
        mat_b,
        _blockwise_scale(a),
        kinds[_blockwise_kind(a)],  # type: ignore[index]
        _blockwise_scale(b),
        kinds[_blockwise_kind(b)],  # type: ignore[index]
        output_dtype=out_dtype,
    )
