"""Block-scaled FP8 quantization: the reference every kernel is tested against.

A 2-D tensor ``x`` of shape ``[M, K]`` is cut into blocks of ``block = (bm, bk)`` elements; ``-1``
means the whole dimension. The blocks the recipes use:

* ``(1, 128)``   - 1x128 tiles: one scale per token per 128 channels (activations, output grads);
* ``(128, 1)``   - 128x1 tiles: one scale per 128 tokens per channel (wgrad operands);
* ``(128, 128)`` - 128x128 blocks (weights);
* ``(1, -1)``    - one scale per row; ``(-1, -1)`` - one scale per tensor.

Per block (TransformerEngine ``Float8BlockScaling`` semantics, computed in fp32)::

    amax  = max |x|                            over the elements that exist (edge blocks are partial)
    scale = fmax / amax                         1 if amax is 0 or not finite; FLT_MAX if that overflows
    scale = 2 ** floor(log2(scale))             when pow2_scale (UE8M0 scales), by clearing mantissa bits
    data  = saturating_cast(x * scale)          finite values clamp to +-fmax
    scale_inv = 1 / scale                       dequantize: x' = data * scale_inv

Non-finite values are never hidden: NaN stays NaN, and an infinity becomes NaN in E4M3 (which has
no infinity; saturating it to 448 would turn an overflow into a plausible number) and stays
infinite in E5M2. A block holding one gets ``scale = 1``.

``scale`` multiplies to quantize, ``scale_inv`` multiplies to dequantize; only ``scale_inv`` is stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import Fp8Format, get_format

__all__ = ["Block", "amax_to_scale", "dequantize", "expand_blocks", "quantize", "resolve_block"]

Block = tuple[int, int]

_FLT_MAX = float(torch.finfo(torch.float32).max)
_EXPONENT_MASK = -8388608  # 0xFF800000 as int32: sign + exponent bits of an fp32


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


def _check_input(x: torch.Tensor) -> None:
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


def amax_to_scale(amax: torch.Tensor, fmt: Fp8Format, pow2_scale: bool) -> torch.Tensor:
    """fp32 ``scale = fmax / amax`` with the recipe's rules for zero, non-finite and overflow."""
    amax = amax.float()
    # a true fp32 division (``python_scalar / tensor`` would multiply by a rounded reciprocal);
    # an amax so small that fmax / amax overflows gets FLT_MAX
    scale = (amax.new_tensor(fmt.max) / amax).clamp_(max=_FLT_MAX)
    scale = torch.where(torch.isfinite(amax) & (amax != 0), scale, 1.0)
    if pow2_scale:  # floor to a power of two: keep sign and exponent, clear the mantissa
        scale = (scale.view(torch.int32) & _EXPONENT_MASK).view(torch.float32)
    return scale


def _saturating_cast(y: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Clamp finite values to +-fmax; NaN stays NaN; +-inf stays inf (E5M2) or becomes NaN (E4M3)."""
    if fmt.has_inf:
        return torch.where(torch.isinf(y), y, y.clamp(-fmt.max, fmt.max)).to(fmt.dtype)
    # y - y is +0 where y is finite and NaN where it is +-inf or NaN; subtracting +0 keeps every finite
    # value (and the sign of -0) bit for bit. Two cheap passes instead of isinf + where.
    not_finite = y - y
    return y.clamp(-fmt.max, fmt.max).sub_(not_finite).to(fmt.dtype)


def quantize(
    x: torch.Tensor, block: Block, fmt: str = "e4m3", pow2_scale: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` per block; returns ``(data [M, K] fp8, scale_inv [ceil(M/bm), ceil(K/bk)] fp32)``."""
    _check_input(x)
    f = get_format(fmt)
    m, k = x.shape
    blocks = expand_blocks(x.float(), block)  # [Mb, bm, Kb, bk]
    if blocks.numel():
        amax = blocks.abs().amax(dim=(1, 3))
    else:
        amax = blocks.new_zeros(blocks.shape[0], blocks.shape[2])
    scale = amax_to_scale(amax, f, pow2_scale)  # [Mb, Kb]
    scaled = blocks * scale[:, None, :, None]
    data = _saturating_cast(scaled, f).reshape(blocks.shape[0] * blocks.shape[1], -1)[:m, :k]
    return data.contiguous(), scale.reciprocal()


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
