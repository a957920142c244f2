"""Triton block-scaled FP8 GEMM ``a @ b.T`` with fp32 accumulation promoted per 128-K block.

The DeepSeek-V3 ``fp8_gemm`` scheme: for each 128-wide slice of the reduction dimension K the tensor
cores multiply the raw FP8 tiles (``[BM,128] @ [128,BN]``, fp32 accumulate), and the partial result
is scaled by that slice's ``scale_inv`` of each operand before it joins the fp32 running sum::

    C[m, n] = sum_kb  (sum_{k in kb} A[m, k] B[n, k]) * sa[m // a_bm, kb] * sb[n // b_bn, kb]

Operands: ``a [M, K]`` with ``(1, 128)`` or ``(128, 128)`` blocks, ``b [N, K]`` likewise: the three
GEMMs of the blockwise recipe (fprop 1x128 x 128x128, dgrad 1x128 x 128x128 transposed, wgrad
1x128 x 1x128 after transposing the 128x1 operands). Any strides: the kernel reads through them, so
a transposed view costs no copy (it is fastest when K is the contiguous dimension of both).
Edge tiles of M, N and K are masked (partial blocks load zeros).

Offsets are int64 (an ``[M, K]`` operand of 2**31 elements or more would wrap in Triton's int32),
the launch enters the operands' device, and the software-pipelining depth follows the device's
shared memory: one stage holds an A and a B tile, ``2 * 128 * 128`` bytes of FP8 (32 KiB), so
Hopper (227 KiB per block) gets the 3 stages this was written for and Ada (99 KiB) gets 2
(:func:`num_stages`).

This is the portable fallback; on SM90 with CUDA >= 12.9 ``scaled_mm.gemm_nt_blockwise`` (cuBLAS) is
preferred. Plain-torch reference with the same signature: :func:`infir2.kernels.emulated.gemm_nt`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..fp8.formats import BLOCK
from .operand import Operand
from .triton_quant import launch_guard

__all__ = ["gemm_nt", "num_stages", "supports_operands"]

_BLOCK_M = 128
_BLOCK_N = 128
_GROUP_M = 8  # programs that share a band of A rows (L2 reuse)
_MAX_STAGES = 3  # the depth written for Hopper (not tuned on a GPU yet)
_STAGE_BYTES = (_BLOCK_M + _BLOCK_N) * BLOCK  # one FP8 A tile and one B tile
_EPILOGUE_BYTES = 16 * 1024  # scales, layout conversions and Triton's own scratch, an allowance


@triton.jit
def _gemm_nt_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: no Python annotations
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_sam,
    stride_sak,
    stride_sbn,
    stride_sbk,
    stride_cm,
    stride_cn,
    A_BM: tl.constexpr,
    B_BN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size)
    pid_n = (pid % (GROUP_M * num_n)) // group_size

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: see the module doc
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :] * stride_bk
    sa_ptrs = sa_ptr + (offs_m // A_BM) * stride_sam
    sb_ptrs = sb_ptr + (offs_n // B_BN) * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)  # [BM, BK] fp8
        b = tl.load(b_ptrs, mask=mask_n[:, None] & (offs_k[None, :] < k_left), other=0.0)  # [BN, BK] fp8
        sa = tl.load(sa_ptrs + kb * stride_sak, mask=mask_m, other=0.0)  # [BM] scale_inv of A
        sb = tl.load(sb_ptrs + kb * stride_sbk, mask=mask_n, other=0.0)  # [BN] scale_inv of B
        partial = tl.dot(a, tl.trans(b))  # [BM,BK] @ [BK,BN] -> [BM,BN], fp32 accumulate
        acc += partial * sa[:, None] * sb[None, :]  # promote: scale this K-block, add in fp32
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _row_block(op: Operand) -> int | None:
    """The operand's block height (1 or 128) if its blocks are 128 wide along K, else None."""
    bm, bk = op.block
    return bm if bk == BLOCK and bm in (1, BLOCK) else None


def supports_operands(a: Operand, b: Operand) -> bool:
    """True for (1|128)x128 blocks on both operands, FP8 data, same reduction length."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    return (
        _row_block(a) is not None
        and _row_block(b) is not None
        and a.data.dtype in fp8
        and b.data.dtype in fp8
        and a.shape[1] == b.shape[1]
    )


def stages_for(shared_memory_bytes: int) -> int:
    """Pipelining stages that fit ``shared_memory_bytes`` per block (at least 1, at most 3)."""
    return max(1, min(_MAX_STAGES, (shared_memory_bytes - _EPILOGUE_BYTES) // _STAGE_BYTES))


@functools.cache
def num_stages(device: torch.device) -> int:
    """:func:`stages_for` the opt-in shared memory per block of ``device`` (3 off CUDA: the interpreter)."""
    if device.type != "cuda":
        return _MAX_STAGES
    index = device.index if device.index is not None else torch.cuda.current_device()
    smem = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0)
    if not smem:  # a torch without the field: Triton's driver knows it
        smem = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return stages_for(int(smem))


def gemm_nt(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b [N, K].T -> [M, N]`` in ``out_dtype``, fp32 accumulation per 128-K block."""
    if not supports_operands(a, b):
        raise ValueError(
            f"triton gemm_nt takes (1|128)x128 blocks, got {a.block} x {b.block} "
            f"for shapes {tuple(a.shape)} x {tuple(b.shape)}"
        )
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()
    grid = (triton.cdiv(m, _BLOCK_M) * triton.cdiv(n, _BLOCK_N),)
    sa, sb = a.scale_inv, b.scale_inv
    with launch_guard(c):
        _gemm_nt_kernel[grid](
            a.data,
            b.data,
            sa,
            sb,
            c,
            m,
            n,
            k,
            a.data.stride(0),
            a.data.stride(1),
            b.data.stride(0),
            b.data.stride(1),
            sa.stride(0),
            sa.stride(1),
            sb.stride(0),
            sb.stride(1),
            c.stride(0),
            c.stride(1),
            A_BM=_row_block(a),
            B_BN=_row_block(b),
            BLOCK_M=_BLOCK_M,
            BLOCK_N=_BLOCK_N,
            BLOCK_K=BLOCK,
            GROUP_M=_GROUP_M,
            num_warps=8,
            num_stages=num_stages(c.device),
        )
    return c
