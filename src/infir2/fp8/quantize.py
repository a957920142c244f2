"""Block-scaled FP8 quantization: the reference every kernel is tested against.

A 2-D tensor ``x`` of shape ``[M, K]`` is cut into blocks of ``block = (bm, bk)`` elements; ``-1``
means the whole dimension. The blocks the recipes use:

* ``(1, 128)``   - 1x128 tiles: one scale per token per 128 channels (activations, output grads);
* ``(128, 1)``   - 128x1 tiles: one scale per 128 tokens per channel (wgrad operands);
* ``(128, 128)`` - 128x128 blocks (weights);
* ``(1, -1)``    - one scale per row; ``(-1, -1)`` - one scale per tensor.

* ``(1, 32)`` / ``(32, 1)`` - the 32-element blocks of MXFP8.

Per block, with one of three scale encodings (``scale_encoding``)::

    amax  = max |x|                            over the elements that exist (edge blocks are partial)
    "fp32": scale = fmax / amax                 1 if amax is 0 or not finite; FLT_MAX if that overflows
    "pow2": scale = 2 ** floor(log2(fmax / amax))   the fp32 scale with its mantissa bits cleared
    "e8m0": scale_inv = 2 ** ceil(log2(amax / fmax)) clamped to [2**-127, 2**127], 1 if amax is 0 or
            not finite; stored as E8M0 (``torch.float8_e8m0fnu``: one byte, the biased exponent)
    data  = saturating_cast(x * scale)          finite values clamp to +-fmax
    scale_inv = 1 / scale                       dequantize: x' = data * scale_inv

"fp32" and "pow2" are TransformerEngine's ``Float8BlockScaling`` (the InfiR2 / DeepSeek-V3 recipe; pow2
rounds the scale *down*, so the largest element may land on fmax). "e8m0" is the OCP Microscaling rule
as trained on Blackwell: it rounds the scale_inv *up*, so that no element exceeds fmax and none
saturates; the scale_inv is a power of two that E8M0 holds exactly (``scale_inv.view(torch.uint8)``
gives the biased exponent codes, ``scale_inv.float()`` the fp32 values).

Non-finite values are never hidden: NaN stays NaN, and an infinity becomes NaN in E4M3 (which has
no infinity; saturating it to 448 would turn an overflow into a plausible number) and stays
infinite in E5M2. A block holding one gets ``scale = 1``. Every NaN is the byte 0x7F (``NAN_CODE``),
on every backend.

No host synchronization: every constant is made on the input's device (a fill, never a copy of a
Python number to the GPU), and nothing reads a value back to the host.

``scale`` multiplies to quantize, ``scale_inv`` multiplies to dequantize; only ``scale_inv`` is stored.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F

from .formats import E8M0_BIAS, E8M0_MAX_EXP, EXPONENT_MASK, FLT_MAX, NAN_CODE, Fp8Format, get_format

__all__ = [
    "SCALE_ENCODINGS",
    "Block",
    "ScaleEncoding",
    "amax_to_scale",
    "block_amax",
    "check_quantize_input",
    "dequantize",
    "expand_blocks",
    "quantize",
    "quantize_with_amax",
    "resolve_block",
    "resolve_encoding",
    "saturating_cast",
    "to_e8m0",
]

Block = tuple[int, int]
ScaleEncoding = Literal["fp32", "pow2", "e8m0"]
SCALE_ENCODINGS: tuple[str, ...] = get_args(ScaleEncoding)


def resolve_encoding(scale_encoding: ScaleEncoding) -> ScaleEncoding:
    """Check a scale encoding (one of :data:`SCALE_ENCODINGS`)."""
    if not isinstance(scale_encoding, str) or scale_encoding not in SCALE_ENCODINGS:
        raise ValueError(f"unknown scale encoding {scale_encoding!r}; expected one of {SCALE_ENCODINGS}")
    return scale_encoding


def resolve_block(block: Block, shape: tuple[int, ...] | torch.Size) -> Block:
    """Turn ``block`` (entries > 0 or -1) into concrete sizes for a 2-D ``shape``."""
    if not (isinstance(block, (tuple, list)) and len(block) == 2):
        raise ValueError(f"block must be a pair (rows, cols), got {block!r}")
    out = []
    for b, n in zip(block, shape, strict=True):
        if isinstance(b, bool) or not isinstance(b, int) or not (b > 0 or b == -1):
            raise ValueError(f"block entries must be positive ints or -1 (whole dimension), got {block!r}")
        out.append(max(n, 1) if b == -1 else b)
    return out[0], out[1]


def check_quantize_input(x: torch.Tensor) -> None:
    """The one check of what every quantizer takes (the reference and each backend): a 2-D
    floating-point tensor ``[M, K]`` wider than one byte; else one line saying what was expected."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor [M, K], got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        raise ValueError(f"quantize expects a floating-point tensor (fp32/bf16/fp16/fp64), got {x.dtype}")


def expand_blocks(x: torch.Tensor, block: Block) -> torch.Tensor:
    """View ``x [M, K]`` as ``[Mb, bm, Kb, bk]``, zero-padding partial edge blocks."""
    bm, bk = resolve_block(block, x.shape)
    m, k = x.shape
    pad_m, pad_k = (-m) % bm, (-k) % bk
    if pad_m or pad_k:
        x = F.pad(x, (0, pad_k, 0, pad_m))
    return x.reshape((m + pad_m) // bm, bm, (k + pad_k) // bk, bk)


def amax_to_scale(amax: torch.Tensor, fmt: Fp8Format, scale_encoding: ScaleEncoding = "pow2") -> torch.Tensor:
    """fp32 ``scale`` (multiplies to quantize) from the block amax, by the encoding's rule (module doc)."""
    encoding = resolve_encoding(scale_encoding)
    amax = amax.float()
    usable = torch.isfinite(amax) & (amax != 0)
    if encoding == "e8m0":
        return _e8m0_scale_inv(amax, fmt, usable).reciprocal()  # a power of two: exact
    # a true fp32 division (``python_scalar / tensor`` would multiply by a rounded reciprocal) of a
    # numerator filled on amax's device (``amax.new_tensor(fmax)`` would be a blocking host-to-device
    # copy on CUDA); an amax so small that fmax / amax overflows gets FLT_MAX
    scale = torch.full_like(amax, fmt.max).div_(amax).clamp_(max=FLT_MAX)
    scale = torch.where(usable, scale, 1.0)
    if encoding == "pow2":  # floor to a power of two: keep sign and exponent, clear the mantissa
        scale = (scale.view(torch.int32) & EXPONENT_MASK).view(torch.float32)
    return scale


def _e8m0_scale_inv(amax: torch.Tensor, fmt: Fp8Format, usable: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(amax / fmax))`` (exact: the quotient in fp64 cannot cross a power of two),
    clamped to the E8M0 range; 1 where the amax is zero or not finite."""
    mantissa, exponent = torch.frexp(
        amax.double() / fmt.max
    )  # q = mantissa * 2**exponent, mantissa in [0.5, 1)
    k = exponent - (mantissa == 0.5).int()  # q == 2**(exponent-1) exactly: no rounding up
    k = torch.where(usable, k.clamp(-E8M0_MAX_EXP, E8M0_MAX_EXP), 0)
    return (k + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu).float()


def to_e8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """Powers of two in fp32 (2**-127 .. 2**127) as E8M0 (their biased exponents), bit-exact."""
    codes = (scale_inv.float().view(torch.int32) >> 23) & 0xFF  # 2**-127 is subnormal: bits 1 << 22 -> 0
    return codes.to(torch.uint8).view(torch.float8_e8m0fnu)


def saturating_cast(y: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Clamp finite values to +-fmax; NaN stays NaN; +-inf stays inf (E5M2) or becomes NaN (E4M3).

    Every NaN is written as the one byte :data:`~infir2.fp8.formats.NAN_CODE` (0x7F), whatever its
    sign or payload: the byte the GPU's conversion and the Triton kernels write (torch's CPU cast keeps
    the sign, and ``inf - inf`` is a negative NaN on x86).
    """
    if fmt.has_inf:
        saturated = torch.where(torch.isinf(y), y, y.clamp(-fmt.max, fmt.max))
    else:
        # y - y is +0 where y is finite and NaN where it is +-inf or NaN; subtracting +0 keeps every
        # finite value (and the sign of -0) bit for bit. Two cheap passes instead of isinf + where.
        saturated = y.clamp(-fmt.max, fmt.max).sub_(y - y)
    data = saturated.to(fmt.dtype)
    return data.view(torch.uint8).masked_fill_(saturated.isnan(), NAN_CODE).view(fmt.dtype)


def block_amax(x: torch.Tensor, block: Block) -> torch.Tensor:
    """fp32 ``max |x|`` per block of ``x [M, K]``: ``[ceil(M/bm), ceil(K/bk)]`` (0 for an empty ``x``)."""
    blocks = expand_blocks(x.float(), block)  # [Mb, bm, Kb, bk]
    if not blocks.numel():
        return blocks.new_zeros(blocks.shape[0], blocks.shape[2])
    return blocks.abs().amax(dim=(1, 3))


def quantize_with_amax(
    x: torch.Tensor,
    amax: torch.Tensor,
    block: Block,
    fmt: str = "e4m3",
    scale_encoding: ScaleEncoding = "pow2",
    row_offset: int = 0,
    n_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` with block scales from a given block ``amax``: the scale rule and the cast.

    ``x`` is rows ``row_offset .. row_offset + M`` of an ``[n_rows, K]`` matrix (default: the whole
    matrix) and ``amax [ceil(n_rows/bm), ceil(K/bk)]`` that matrix's block amax, so a shard of a
    matrix gets exactly the codes of those rows of :func:`quantize` of the whole (FSDP2's FP8 weight
    all-gather, ``infir2.nn.fsdp``). Returns ``(data [M, K] fp8, scale_inv)`` with the full
    ``scale_inv`` (fp32, or E8M0 for ``scale_encoding="e8m0"``).
    """
    encoding = resolve_encoding(scale_encoding)
    f = get_format(fmt)
    m, k = x.shape
    n_rows = m if n_rows is None else n_rows
    bm, bk = resolve_block(block, (n_rows, k))
    scale = amax_to_scale(amax, f, encoding)  # [Nb, Kb]
    scale_inv = scale.reciprocal()
    scale_inv = to_e8m0(scale_inv) if encoding == "e8m0" else scale_inv
    if row_offset == 0 and n_rows == m:  # the whole matrix: block scales broadcast over each block
        blocks = expand_blocks(x.float(), (bm, bk))  # [Mb, bm, Kb, bk]
        scaled = blocks * scale[:, None, :, None]
        data = saturating_cast(scaled, f).reshape(blocks.shape[0] * bm, -1)[:m, :k]
        return data.contiguous(), scale_inv
    if m == 0:
        return torch.empty(0, k, dtype=f.dtype, device=x.device), scale_inv
    rows = torch.arange(row_offset, row_offset + m, device=x.device)
    row_scale = scale[torch.div(rows, bm, rounding_mode="floor")]  # [M, Kb]: each row's block scales
    blocks = expand_blocks(x.float(), (1, bk))  # [M, 1, Kb, bk]
    data = saturating_cast(blocks * row_scale[:, None, :, None], f).reshape(m, -1)[:, :k]
    return data.contiguous(), scale_inv


def quantize(
    x: torch.Tensor, block: Block, fmt: str = "e4m3", scale_encoding: ScaleEncoding = "pow2"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` per block; returns ``(data [M, K] fp8, scale_inv [ceil(M/bm), ceil(K/bk)])``.

    ``scale_inv`` is fp32, or ``float8_e8m0fnu`` for ``scale_encoding="e8m0"`` (``.float()`` reads it).
    The block amax (:func:`block_amax`), then :func:`quantize_with_amax`.
    """
    check_quantize_input(x)
    encoding = resolve_encoding(scale_encoding)
    get_format(fmt)
    return quantize_with_amax(x, block_amax(x, block), block, fmt, encoding)


def dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor, block: Block, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``data * scale_inv`` broadcast over each block, cast to ``dtype``."""
    if data.dim() != 2:
        raise ValueError(f"dequantize expects 2-D data, got shape {tuple(data.shape)}")
    m, k = data.shape
    blocks = expand_blocks(data.float(), block)
    if scale_inv.shape != (blocks.shape[0], blocks.shape[2]):
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match data {tuple(data.shape)} "
            f"with block {tuple(block)}: expected {(blocks.shape[0], blocks.shape[2])}"
        )
    out = blocks * scale_inv.float()[:, None, :, None]
    return out.reshape(blocks.shape[0] * blocks.shape[1], -1)[:m, :k].to(dtype)
