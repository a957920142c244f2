"""Triton quantization kernels: one pass over memory per quantization, same results as the reference.

``quantize(x, block, fmt, scale_encoding)`` has the contract of :func:`infir2.fp8.quantize` for the three
block shapes of the blockwise recipe, and returns bit-identical values (same fp32 math: IEEE
division, mantissa-clearing pow2 rounding, saturating round-to-nearest-even cast). Each program
loads one tile of ``x`` once, reduces ``amax`` per block in registers, and writes the FP8 data and
``scale_inv``:

* ``(1, 128)``   tile ``[ROWS, 128]``: one scale per row of the tile (activations, output grads);
* ``(128, 1)``   tile ``[128, COLS]``: one scale per column (wgrad operands);
* ``(128, 128)`` tile ``[128, 128]``: one scale per tile (weights).

Layouts are the ones the GEMMs want, so nothing is copied afterwards (the values are the same as the
reference's whatever the strides; ``Operand`` and ``dequantize`` accept any strides):

* ``(128, 1)``: ``data`` is written transposed, physically ``[K, M]`` and returned as a ``[M, K]`` view.
  wgrad multiplies ``Q(dY).T @ Q(X)``, i.e. it reduces over tokens; with this layout ``Operand.t()`` is
  a contiguous ``[K, M]`` matrix whose reduction dimension (tokens) is the fast one, which is what
  cuBLAS (row-major A, column-major B) and a K-major tensor-core load want.
* ``(1, 128)``: ``scale_inv [M, K/128]`` is written "outer-dim-major" (physically ``[K/128, M]``),
  the layout ``torch.nn.functional.scaled_mm`` requires for ``BlockWise1x128`` scales.

The FP8 bytes are chosen, not left to the conversion instruction, where the two could differ: on
SM89 / SM90 Triton lowers ``fp32 -> fp8`` to ``cvt.rn.satfinite``, which turns +-inf into +-max, so
E5M2 infinities (kept by the reference) and NaNs are selected after the cast (:func:`_fp8_codes`).
Offsets are computed in int64 (the program index is widened before it is multiplied): Triton keeps
``offs * stride`` in int32, which wraps for a 2-D tensor of 2**31 elements or more (a
``[131072, 18944]`` MLP activation). Kernels launch on the input's device, not the current one.

Plain-torch reference with the same signature: :func:`infir2.fp8.quantize`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import triton
import triton.language as tl

from ..fp8.formats import BLOCK, EXPONENT_MASK, FLT_MAX, NAN_CODE, get_format
from ..fp8.quantize import Block, ScaleEncoding, resolve_block

__all__ = [
    "SUPPORTED_BLOCKS",
    "launch_guard",
    "quantize",
    "quantize_both",
    "quantize_with_scale",
    "supports_block",
]

#: The block shapes these kernels implement; others go to the reference.
SUPPORTED_BLOCKS: tuple[Block, ...] = ((1, BLOCK), (BLOCK, 1), (BLOCK, BLOCK))

_ROWS_PER_PROGRAM = 16  # (1, 128) tiles: rows per program
_COLS_PER_PROGRAM = 32  # (128, 1) tiles: columns per program


#: sign + exponent bits of an fp32 (a global of a Triton kernel must be a constexpr)
_EXPONENT_MASK = tl.constexpr(EXPONENT_MASK)


#: FP8 bytes the kernels select explicitly (sign bit 0x80): E5M2 +inf, and the NaN both formats share
_E5M2_INF = tl.constexpr(0x7C)
_FP8_NAN = tl.constexpr(NAN_CODE)


def launch_guard(t: torch.Tensor) -> AbstractContextManager[Any]:
    """Enter ``t``'s CUDA device for a launch (Triton launches on the current device, not the tensor's)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else nullcontext()


@triton.jit
def _scale_from_amax(amax, nonfinite, FMAX: tl.constexpr, FLT_MAX: tl.constexpr, POW2: tl.constexpr):  # type: ignore[no-untyped-def]  # a Triton kernel
    """fp32 ``scale = fmax / amax`` (IEEE division), 1 for a zero or non-finite amax, pow2 floor."""
    scale = tl.math.div_rn(tl.full(amax.shape, FMAX, tl.float32), amax)
    scale = tl.where(scale == float("inf"), FLT_MAX, scale)
    scale = tl.where((amax == 0.0) | nonfinite, 1.0, scale)
    if POW2:  # keep sign + exponent bits (0xFF800000): 2 ** floor(log2(scale))
        scale = (scale.to(tl.int32, bitcast=True) & _EXPONENT_MASK).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _saturate(y, FMAX: tl.constexpr, HAS_INF: tl.constexpr):  # type: ignore[no-untyped-def]  # a Triton kernel
    """Clamp finite values to +-fmax; NaN stays NaN; inf stays inf (E5M2) or becomes NaN (E4M3)."""
    clamped = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y))  # NaN fails both tests: kept
    is_inf = tl.abs(y) == float("inf")
    if HAS_INF:
        return tl.where(is_inf, y, clamped)
    return tl.where(is_inf, float("nan"), clamped)


@triton.jit
def _fp8_codes(y, HAS_INF: tl.constexpr):  # type: ignore[no-untyped-def]  # a Triton kernel
    """The FP8 byte of each saturated value ``y``: the conversion for finite values; +-inf (E5M2) and NaN
    selected after it, since the GPU's ``cvt.rn.satfinite`` would turn inf into +-max."""
    if HAS_INF:
        codes = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
        sign = tl.where(y < 0, 0x80, 0).to(tl.uint8)
        codes = tl.where(tl.abs(y) == float("inf"), sign | _E5M2_INF, codes)
    else:
        codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.where(y != y, _FP8_NAN, codes).to(tl.uint8)


@triton.jit
def _store_data(ptrs, y, mask, CODES: tl.constexpr, HAS_INF: tl.constexpr):  # type: ignore[no-untyped-def]  # a Triton kernel
    """Store FP8 bytes (``CODES``: ``ptrs`` are uint8) or, for the tests, the fp32 values before the cast."""
    if CODES:
        tl.store(ptrs, _fp8_codes(y, HAS_INF), mask=mask)
    else:
        tl.store(ptrs, y.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: no Python annotations
    x_ptr,
    data_ptr,
    scale_inv_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_dm,
    stride_dk,
    stride_sm,
    stride_sk,
    BM: tl.constexpr,
    BK: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_K: tl.constexpr,
    FMAX: tl.constexpr,
    FLT_MAX: tl.constexpr,
    POW2: tl.constexpr,
    HAS_INF: tl.constexpr,
    CODES: tl.constexpr,
):
    """One program quantizes the tile ``x[TILE_M rows, TILE_K cols]`` made of ``(BM, BK)`` blocks."""
    pid_m = tl.program_id(0).to(tl.int64)  # int64 offsets from here on (module doc)
    pid_k = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * TILE_M + tl.arange(0, TILE_M)
    offs_k = pid_k * TILE_K + tl.arange(0, TILE_K)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0)
    xa = tl.abs(x.to(tl.float32))  # padding is 0: partial blocks take amax over what exists
    bad = ((xa != xa) | (xa == float("inf"))).to(tl.int32)  # explicit: no reliance on max's NaN rule
    if BM == 1:  # (1, BK) tiles: one scale per row  -> [TILE_M, 1]
        amax = tl.max(xa, axis=1)[:, None]
        nonfinite = tl.max(bad, axis=1)[:, None] > 0
    elif BK == 1:  # (BM, 1) tiles: one scale per column -> [1, TILE_K]
        amax = tl.max(xa, axis=0)[None, :]
        nonfinite = tl.max(bad, axis=0)[None, :] > 0
    else:  # one (BM, BK) block per program -> [1, 1]
        amax = tl.zeros((1, 1), tl.float32) + tl.max(tl.max(xa, axis=1), axis=0)  # scalar -> [1, 1]
        nonfinite = (tl.zeros((1, 1), tl.int32) + tl.max(tl.max(bad, axis=1), axis=0)) > 0
    scale = _scale_from_amax(amax, nonfinite, FMAX, FLT_MAX, POW2)
    y = _saturate(x.to(tl.float32) * scale, FMAX, HAS_INF)
    _store_data(data_ptr + offs_m[:, None] * stride_dm + offs_k[None, :] * stride_dk, y, mask, CODES, HAS_INF)
    scale_inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    if BM == 1:
        tl.store(
            scale_inv_ptr + offs_m[:, None] * stride_sm + pid_k * stride_sk,
            scale_inv,
            mask=offs_m[:, None] < M,
        )
    elif BK == 1:
        tl.store(
            scale_inv_ptr + pid_m * stride_sm + offs_k[None, :] * stride_sk,
            scale_inv,
            mask=offs_k[None, :] < K,
        )
    else:
        tl.store(
            scale_inv_ptr + pid_m * stride_sm + pid_k * stride_sk + tl.zeros((1, 1), tl.int64), scale_inv
        )


@triton.jit
def _quantize_both_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: no Python annotations
    x_ptr,
    row_data_ptr,
    row_scale_inv_ptr,
    col_data_ptr,
    col_scale_inv_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_rdm,
    stride_rdk,
    stride_rsm,
    stride_rsk,
    stride_cdm,
    stride_cdk,
    stride_csm,
    stride_csk,
    TILE: tl.constexpr,
    FMAX: tl.constexpr,
    FLT_MAX: tl.constexpr,
    POW2: tl.constexpr,
    HAS_INF: tl.constexpr,
    CODES: tl.constexpr,
):
    """One read of a ``[TILE, TILE]`` tile, two quantizations: 1x``TILE`` tiles (one scale per row) and
    ``TILE``x1 tiles (one scale per column), for the fprop/dgrad and the wgrad copy of the same tensor."""
    pid_m = tl.program_id(0).to(tl.int64)  # int64 offsets from here on (module doc)
    pid_k = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * TILE + tl.arange(0, TILE)
    offs_k = pid_k * TILE + tl.arange(0, TILE)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    xa = tl.abs(x)
    bad = ((xa != xa) | (xa == float("inf"))).to(tl.int32)
    # 1 x TILE tiles: one scale per row -> [TILE, 1]
    row_scale = _scale_from_amax(
        tl.max(xa, axis=1)[:, None], tl.max(bad, axis=1)[:, None] > 0, FMAX, FLT_MAX, POW2
    )
    row = _saturate(x * row_scale, FMAX, HAS_INF)
    _store_data(
        row_data_ptr + offs_m[:, None] * stride_rdm + offs_k[None, :] * stride_rdk, row, mask, CODES, HAS_INF
    )
    row_scale_inv = tl.math.div_rn(tl.full(row_scale.shape, 1.0, tl.float32), row_scale)
    tl.store(
        row_scale_inv_ptr + offs_m[:, None] * stride_rsm + pid_k * stride_rsk,
        row_scale_inv,
        mask=offs_m[:, None] < M,
    )
    # TILE x 1 tiles: one scale per column -> [1, TILE]
    col_scale = _scale_from_amax(
        tl.max(xa, axis=0)[None, :], tl.max(bad, axis=0)[None, :] > 0, FMAX, FLT_MAX, POW2
    )
    col = _saturate(x * col_scale, FMAX, HAS_INF)
    _store_data(
        col_data_ptr + offs_m[:, None] * stride_cdm + offs_k[None, :] * stride_cdk, col, mask, CODES, HAS_INF
    )
    col_scale_inv = tl.math.div_rn(tl.full(col_scale.shape, 1.0, tl.float32), col_scale)
    tl.store(
        col_scale_inv_ptr + pid_m * stride_csm + offs_k[None, :] * stride_csk,
        col_scale_inv,
        mask=offs_k[None, :] < K,
    )


def _pow2(scale_encoding: ScaleEncoding) -> bool:
    """The kernels' ``POW2`` switch: ``"pow2"`` or ``"fp32"`` scales (E8M0 is not implemented here)."""
    if scale_encoding not in ("fp32", "pow2"):
        raise ValueError(f"triton quantize takes fp32 or pow2 scales, got {scale_encoding!r}")
    return scale_encoding == "pow2"


def supports_block(block: Block, shape: tuple[int, ...] | torch.Size) -> bool:
    """True when ``block`` (resolved against ``shape``) is one of :data:`SUPPORTED_BLOCKS`."""
    return resolve_block(block, shape) in SUPPORTED_BLOCKS and len(shape) == 2


def quantize(
    x: torch.Tensor, block: Block, fmt: str = "e4m3", scale_encoding: ScaleEncoding = "pow2"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]``; same contract and values as :func:`infir2.fp8.quantize` (see the module doc
    for the output layouts)."""
    return _quantize(x, block, fmt, scale_encoding, data_dtype=None)


def _quantize(
    x: torch.Tensor, block: Block, fmt: str, scale_encoding: ScaleEncoding, data_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize`, optionally writing ``data`` as ``data_dtype`` (tests use float32 to see the
    scaled, saturated values just before the FP8 cast)."""
    if x.dim() != 2 or not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        raise ValueError(f"quantize expects a 2-D floating-point tensor, got {tuple(x.shape)} {x.dtype}")
    if not supports_block(block, x.shape):
        raise ValueError(f"triton quantize takes blocks {SUPPORTED_BLOCKS}, got {tuple(block)}")
    f = get_format(fmt)
    bm, bk = resolve_block(block, x.shape)
    m, k = x.shape
    mb, kb = -(-m // bm), -(-k // bk)
    dtype = data_dtype or f.dtype
    if bk == 1:  # data written transposed: physically [K, M]
        data = torch.empty((k, m), dtype=dtype, device=x.device).t()
    else:
        data = torch.empty((m, k), dtype=dtype, device=x.device)
    if bm == 1:  # scale_inv outer-dim-major: physically [Kb, M]
        scale_inv = torch.empty((kb, mb), dtype=torch.float32, device=x.device).t()
    else:
        scale_inv = torch.empty((mb, kb), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return data, scale_inv.fill_(1.0)
    tile_m = _ROWS_PER_PROGRAM if bm == 1 else bm
    tile_k = _COLS_PER_PROGRAM if bk == 1 else bk
    grid = (triton.cdiv(m, tile_m), triton.cdiv(k, tile_k))
    codes = data_dtype is None  # FP8 output: written as bytes (the module doc)
    with launch_guard(x):
        _quantize_kernel[grid](
            x,
            _bytes(data) if codes else data,
            scale_inv,
            m,
            k,
            x.stride(0),
            x.stride(1),
            data.stride(0),
            data.stride(1),
            scale_inv.stride(0),
            scale_inv.stride(1),
            BM=bm,
            BK=bk,
            TILE_M=tile_m,
            TILE_K=tile_k,
            FMAX=f.max,
            FLT_MAX=FLT_MAX,
            POW2=_pow2(scale_encoding),
            HAS_INF=f.has_inf,
            CODES=codes,
            num_warps=8 if tile_m * tile_k >= 128 * 128 else 4,  # a 128x128 fp32 tile: 64 values per thread
        )
    return data, scale_inv


def _bytes(data: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor viewed as its bytes (same shape and strides)."""
    return data.view(torch.uint8)


def quantize_both(
    x: torch.Tensor, fmt: str = "e4m3", scale_encoding: ScaleEncoding = "pow2"
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``(quantize(x, (1, 128)), quantize(x, (128, 1)))`` from one read of ``x``: the fprop (or dgrad)
    copy and the wgrad copy of an activation or output gradient, same values and layouts as two calls."""
    return _quantize_both(x, fmt, scale_encoding, data_dtype=None)


def _quantize_both(
    x: torch.Tensor, fmt: str, scale_encoding: ScaleEncoding, data_dtype: torch.dtype | None
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    if x.dim() != 2 or not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        raise ValueError(f"quantize_both expects a 2-D floating-point tensor, got {tuple(x.shape)} {x.dtype}")
    f = get_format(fmt)
    m, k = x.shape
    mb, kb = -(-m // BLOCK), -(-k // BLOCK)
    dtype = data_dtype or f.dtype
    row_data = torch.empty((m, k), dtype=dtype, device=x.device)
    row_scale_inv = torch.empty((kb, m), dtype=torch.float32, device=x.device).t()  # [M, Kb], outer-dim-major
    col_data = torch.empty((k, m), dtype=dtype, device=x.device).t()  # [M, K], physically [K, M]
    col_scale_inv = torch.empty((mb, k), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return (row_data, row_scale_inv.fill_(1.0)), (col_data, col_scale_inv.fill_(1.0))
    codes = data_dtype is None
    row_out, col_out = (_bytes(row_data), _bytes(col_data)) if codes else (row_data, col_data)
    with launch_guard(x):
        _quantize_both_kernel[(mb, kb)](
            x,
            row_out,
            row_scale_inv,
            col_out,
            col_scale_inv,
            m,
            k,
            x.stride(0),
            x.stride(1),
            row_data.stride(0),
            row_data.stride(1),
            row_scale_inv.stride(0),
            row_scale_inv.stride(1),
            col_data.stride(0),
            col_data.stride(1),
            col_scale_inv.stride(0),
            col_scale_inv.stride(1),
            TILE=BLOCK,
            FMAX=f.max,
            FLT_MAX=FLT_MAX,
            POW2=_pow2(scale_encoding),
            HAS_INF=f.has_inf,
            CODES=codes,
            num_warps=8,
        )
    return (row_data, row_scale_inv), (col_data, col_scale_inv)


@triton.jit
def _quantize_with_scale_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: no Python annotations
    x_ptr,
    scale_ptr,
    data_ptr,
    M,
    K,
    ROW_OFFSET,
    stride_xm,
    stride_xk,
    stride_sm,
    stride_sk,
    BM: tl.constexpr,
    BK: tl.constexpr,
    TILE: tl.constexpr,
    FMAX: tl.constexpr,
    HAS_INF: tl.constexpr,
    CODES: tl.constexpr,
):
    """Rows ``ROW_OFFSET ..`` of a matrix whose ``(BM, BK)`` block scales are given: one multiply, the
    saturation and the cast per element (no amax: the scales are the whole matrix's)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * TILE + tl.arange(0, TILE)
    offs_k = pid_k * TILE + tl.arange(0, TILE)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0)
    block_m = (offs_m + ROW_OFFSET) // BM
    block_k = offs_k // BK
    scale = tl.load(
        scale_ptr + block_m[:, None] * stride_sm + block_k[None, :] * stride_sk, mask=mask, other=1.0
    )
    y = _saturate(x.to(tl.float32) * scale, FMAX, HAS_INF)
    _store_data(data_ptr + offs_m[:, None] * K + offs_k[None, :], y, mask, CODES, HAS_INF)


def quantize_with_scale(
    x: torch.Tensor, scale: torch.Tensor, block: Block, fmt: str = "e4m3", row_offset: int = 0
) -> torch.Tensor:
    """FP8 data ``[M, K]`` of rows ``row_offset ..`` of a matrix with the block ``scale`` (fp32,
    multiplies to quantize) of the whole matrix: the codes of ``infir2.fp8.quantize_with_amax`` for
    ``scale = amax_to_scale(amax)`` (FSDP2's FP8 weight all-gather quantizes each rank's rows so)."""
    return _quantize_with_scale(x, scale, block, fmt, row_offset, data_dtype=None)


def _quantize_with_scale(
    x: torch.Tensor,
    scale: torch.Tensor,
    block: Block,
    fmt: str,
    row_offset: int,
    data_dtype: torch.dtype | None,
) -> torch.Tensor:
    """:func:`quantize_with_scale`, optionally writing the values before the FP8 cast (``data_dtype``)."""
    if x.dim() != 2 or not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        raise ValueError(
            f"quantize_with_scale expects a 2-D floating-point tensor, got {tuple(x.shape)} {x.dtype}"
        )
    if scale.dtype != torch.float32 or scale.dim() != 2:
        raise ValueError(
            f"quantize_with_scale expects a 2-D fp32 scale, got {tuple(scale.shape)} {scale.dtype}"
        )
    f = get_format(fmt)
    m, k = x.shape
    bm, bk = resolve_block(block, (row_offset + m, k))
    data = torch.empty((m, k), dtype=data_dtype or f.dtype, device=x.device)
    if x.numel() == 0:
        return data
    codes = data_dtype is None
    with launch_guard(x):
        _quantize_with_scale_kernel[(triton.cdiv(m, BLOCK), triton.cdiv(k, BLOCK))](
            x,
            scale,
            _bytes(data) if codes else data,
            m,
            k,
            row_offset,
            x.stride(0),
            x.stride(1),
            scale.stride(0),
            scale.stride(1),
            BM=bm,
            BK=bk,
            TILE=BLOCK,
            FMAX=f.max,
            HAS_INF=f.has_inf,
            CODES=codes,
            num_warps=8,
        )
    return data
