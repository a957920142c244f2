"""Block-scaled FP8 storage of AdamW's moments (``optim.state_dtype: fp8``): the rule, as a reference.

A moment of a parameter of shape ``[..., K]`` is read as rows ``[R, K]``, and each row is cut into
blocks of ``block`` consecutive elements (the last one partial): the flattened parameter's blocks
whenever ``K`` is a multiple of ``block``. Rows, not the flat tensor, so that a parameter FSDP2 shards
by rows has moments that shard with it, each block on one rank: any number of processes stores the
same codes. Per block, the block-scaled rule of ``fp8.quantize`` with an fp32 scale (``fmax / amax``)::

    first moment m         codes = E4M3(m * scale)                     m'  = codes * scale_inv
    second moment v, e5m2   codes = E5M2(v * scale)                     v'  = codes * scale_inv
    second moment v, sqrt   codes = E4M3(sqrt(v) * scale)               v'  = (codes * scale_inv) ** 2

``sqrt`` keeps ``sqrt(v)`` -- what the update divides by -- on the first moment's scale: an element
small against its block's largest has ``m`` and ``sqrt(v)`` flush to zero together, where E5M2's ``v``
spans twice the exponents (``v ~ g^2``) in a format of only 2 mantissa bits.

``expand=True`` adds COAT's dynamic range expansion (Xi et al., 2024): per block, with ``amax`` its
largest magnitude, ``R_x`` the ratio of ``amax`` to its smallest non-zero magnitude and ``R_f`` the
format's ratio of ``fmax`` to its smallest normal number, ``k = clamp(log R_f / log R_x, 1,
MAX_EXPONENT)`` (1 where ``R_x <= 1``) and the block stores ``codes = FMT(sign(x) (|x| / amax) ** k *
fmax)``: a block whose values span few exponents is spread over the format's range before rounding
(its smallest value lands on the smallest normal number), and read back as ``sign(c) (|c| / fmax) **
(1 / k) * amax``. Normalizing by ``amax`` first keeps ``x ** k`` inside fp32's range. ``k`` and ``amax``
(in place of the scale) are kept per block in fp32.

Codes are stored as ``uint8`` (the FP8 byte): checkpoints and collectives then move plain bytes (gloo
cannot gather FP8 dtypes) and torch's optimizer loader, which casts floating state to the parameter's
dtype, leaves them alone. All the math is fp32, and deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from .formats import get_format
from .quantize import block_amax, dequantize, quantize

__all__ = [
    "MAX_EXPONENT",
    "SECOND_MOMENT_FORMATS",
    "STEP_ELEMENTS",
    "MomentCodes",
    "dequantize_moment",
    "moment_bytes_per_element",
    "quantize_moment",
]

SecondMoment = Literal["e5m2", "sqrt_e4m3"]
#: how the second moment is stored: its own E5M2 codes, or the E4M3 codes of its square root
SECOND_MOMENT_FORMATS: tuple[SecondMoment, ...] = ("e5m2", "sqrt_e4m3")
#: elements of a parameter that infir2's AdamWs update at once: a larger one goes by slices of whole rows
#: (the update is elementwise and a moment's blocks lie in one row, so the bits are the same), and the
#: step's fp32 temporaries -- the moments read back, the quantizer's -- are a few copies of this many
#: (64 MiB each) whatever the model; ``planning.optimizer`` counts them
STEP_ELEMENTS = 1 << 24
#: the largest range-expansion exponent (a block of nearly equal values would otherwise ask for a huge k)
MAX_EXPONENT = 8.0


@dataclass(frozen=True)
class MomentCodes:
    """One stored moment: ``codes`` (uint8, the parameter's shape), ``scale_inv`` (fp32, ``[..., K_blocks]``;
    with range expansion the blocks' amax) and, with range expansion, ``exponent`` (fp32, the same shape
    as ``scale_inv``; else None)."""

    codes: torch.Tensor
    scale_inv: torch.Tensor
    exponent: torch.Tensor | None = None


def _fmt(kind: str) -> str:
    return "e5m2" if kind == "e5m2" else "e4m3"


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, -1) if x.dim() < 2 else x.reshape(-1, x.shape[-1])


def _block_exponent(rows: torch.Tensor, block: int, fmt: str) -> torch.Tensor:
    """COAT's ``k`` per block of ``rows [R, K]``: ``[R, ceil(K / block)]`` fp32."""
    f = get_format(fmt)
    tiny = torch.finfo(f.dtype).smallest_normal
    r = rows.shape[1]
    pad = (-r) % block
    mag = torch.nn.functional.pad(rows.abs(), (0, pad)).reshape(rows.shape[0], -1, block)
    big = mag.amax(dim=-1)
    small = torch.where(mag > 0, mag, torch.inf).amin(dim=-1)
    ratio = big / small  # inf / inf = nan for an all-zero block, 1 for a constant one
    k = torch.full_like(big, math.log(f.max / tiny)).div_(ratio.log())
    return torch.where(ratio > 1, k, 1.0).nan_to_num_(1.0).clamp_(1.0, MAX_EXPONENT)


def _per_element(t: torch.Tensor, block: int, k: int) -> torch.Tensor:
    """``[R, Kb]`` per-block values repeated over each block's elements: ``[R, K]``."""
    return t.repeat_interleave(block, dim=1)[:, :k]


def quantize_moment(x: torch.Tensor, kind: str, block: int, expand: bool = False) -> MomentCodes:
    """Store moment ``x`` (fp32) by the rule of ``kind``: ``"m"`` (first moment), ``"e5m2"`` or
    ``"sqrt_e4m3"`` (second moment; module doc)."""
    rows = _rows(x.float())
    if kind == "sqrt_e4m3":
        rows = rows.sqrt()
    fmt = _fmt(kind)
    if not expand:
        data, scale_inv = quantize(rows, (1, block), fmt, "fp32")
        return MomentCodes(data.view(torch.uint8).reshape(x.shape), scale_inv.reshape(*_lead(x), -1))
    exponent = _block_exponent(rows, block, fmt)
    amax = block_amax(rows, (1, block))
    k, top = (_per_element(t, block, rows.shape[1]) for t in (exponent, amax))
    unit = torch.where(top > 0, rows.abs() / top, 0.0)  # [0, 1]: powers of it stay in fp32's range
    data, _ = quantize(unit.pow_(k).mul_(rows.sign()), (1, block), fmt, "fp32")
    return MomentCodes(
        data.view(torch.uint8).reshape(x.shape), amax.reshape(*_lead(x), -1), exponent.reshape(*_lead(x), -1)
    )


def _lead(x: torch.Tensor) -> tuple[int, ...]:
    return (1,) if x.dim() < 2 else tuple(x.shape[:-1])


def dequantize_moment(stored: MomentCodes, kind: str, block: int) -> torch.Tensor:
    """The fp32 moment ``stored`` holds (the parameter's shape)."""
    shape = stored.codes.shape
    fmt = get_format(_fmt(kind))
    codes = _rows(stored.codes).view(fmt.dtype)
    scales = stored.scale_inv.reshape(codes.shape[0], -1)
    if stored.exponent is None:
        rows = dequantize(codes, scales, (1, block))
    else:  # expanded: codes of (|x| / amax) ** k * fmax, ``scale_inv`` the block's amax
        k = _per_element(stored.exponent.reshape(codes.shape[0], -1), block, codes.shape[1])
        top = _per_element(scales, block, codes.shape[1])
        y = codes.float()
        rows = (y.abs() / fmt.max).pow_(k.reciprocal()).mul_(top).mul_(y.sign())
    if kind == "sqrt_e4m3":
        rows = rows * rows
    return rows.reshape(shape)


def moment_bytes_per_element(block: int, expand: bool = False) -> float:
    """Bytes per element of one stored moment: the code and a share of its block's fp32 scale (and
    exponent)."""
    return 1 + 4 * (2 if expand else 1) / block
