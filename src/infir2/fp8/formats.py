"""FP8 number formats and the constants of the recipe.

E4M3 (``float8_e4m3fn``) has 4 exponent bits and 3 mantissa bits: max 448, no infinity, one NaN
pattern per sign. E5M2 trades a mantissa bit for range (max 57344, has infinity). The InfiR2 /
DeepSeek-V3 recipe uses E4M3 for every tensor, gradients included; E5M2 is kept for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BLOCK", "FORMATS", "Fp8Format", "get_format"]

#: Edge of the quantization tiles of the blockwise recipe (1x128 activations, 128x128 weights).
BLOCK = 128


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
