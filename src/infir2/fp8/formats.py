"""FP8 number formats and the constants of the recipe.

E4M3 (``float8_e4m3fn``) has 4 exponent bits and 3 mantissa bits: max 448, no infinity, one NaN
pattern per sign. E5M2 trades a mantissa bit for range (max 57344, has infinity). The InfiR2 /
DeepSeek-V3 recipe uses E4M3 for every tensor, gradients included; E5M2 is kept for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BLOCK", "E8M0_BIAS", "E8M0_MAX_EXP", "EXPONENT_MASK", "FLT_MAX", "FORMATS", "MX_BLOCK", "Fp8Format",
           "get_format"]  # fmt: skip

#: Edge of the quantization tiles of the blockwise recipe (1x128 activations, 128x128 weights).
BLOCK = 128
#: Elements per scale block of the OCP Microscaling (MX) formats: 1x32 along the reduction dimension.
MX_BLOCK = 32

#: E8M0, the MX scale format: 8 exponent bits, no sign, no mantissa; code c means 2 ** (c - 127),
#: codes 0..254 span 2**-127 .. 2**127 and 255 is NaN (``torch.float8_e8m0fnu``).
E8M0_BIAS = 127
E8M0_MAX_EXP = 127

#: Largest finite fp32; a scale that would overflow is clamped to it.
FLT_MAX = float(torch.finfo(torch.float32).max)
#: 0xFF800000 as an int32: the sign and exponent bits of an fp32 (clearing the rest floors to a power of two).
EXPONENT_MASK = -8388608


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 format: its torch dtype and largest finite magnitude."""

    name: str
    dtype: torch.dtype
    max: float

    @property
    def has_inf(self) -> bool:
        return self.dtype == torch.float8_e5m2


FORMATS: dict[str, Fp8Format] = {
    "e4m3": Fp8Format("e4m3", torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max)),
    "e5m2": Fp8Format("e5m2", torch.float8_e5m2, float(torch.finfo(torch.float8_e5m2).max)),
}


def get_format(fmt: str | Fp8Format) -> Fp8Format:
    """Look up a format by name (``"e4m3"`` or ``"e5m2"``)."""
    if isinstance(fmt, Fp8Format):
        return fmt
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown FP8 format {fmt!r}; expected one of {sorted(FORMATS)}") from None
