"""FP8 number formats and the constants of the recipe.

E4M3 (``float8_e4m3fn``) has 4 exponent bits and 3 mantissa bits: max 448, no infinity, one NaN
pattern per sign. E5M2 trades a mantissa bit for range (max 57344, has infinity). The InfiR2 /
DeepSeek-V3 recipe uses E4M3 for every tensor, gradients included; E5M2 is kept for comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

__all__ = [
    "BLOCK",
    "E2M1",
    "E8M0_BIAS",
    "E8M0_MAX_EXP",
    "EXPONENT_MASK",
    "FLT_MAX",
    "FORMATS",
    "HADAMARD_SEED",
    "MX_BLOCK",
    "NAN_CODE",
    "NVFP4_BLOCK",
    "BitLayout",
    "Fp4Format",
    "Fp8Format",
    "bit_layout",
    "get_format",
]

#: Edge of the quantization tiles of the blockwise recipe (1x128 activations, 128x128 weights).
BLOCK = 128
#: Elements per scale block of the OCP Microscaling (MX) formats: 1x32 along the reduction dimension.
MX_BLOCK = 32

#: Elements per scale block of NVFP4: 1x16 along the reduction dimension (16x16 for weights); also the
#: size of the random Hadamard transform applied to NVFP4's wgrad operands.
NVFP4_BLOCK = 16
#: The seed of the fixed random sign vector of NVFP4's 16-point random Hadamard transform.
HADAMARD_SEED = 45

#: E8M0, the MX scale format: 8 exponent bits, no sign, no mantissa; code c means 2 ** (c - 127),
#: codes 0..254 span 2**-127 .. 2**127 and 255 is NaN (``torch.float8_e8m0fnu``).
E8M0_BIAS = 127
E8M0_MAX_EXP = 127

#: The FP8 byte every NaN is written as, in E4M3 and in E5M2 (both read it as NaN): sign clear, all
#: seven magnitude bits set. What the GPU's fp32 -> fp8 conversion writes for any NaN, so every backend
#: (the reference, the CPU emulations, the Triton kernels) gives one byte for one value.
NAN_CODE = 0x7F

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


@dataclass(frozen=True)
class Fp4Format:
    """A 4-bit float: 1 sign bit, ``ebits`` exponent bits, ``mbits`` mantissa bits, no inf or NaN.

    A code is a nibble: bit 3 the sign, bits 0-2 the index of the magnitude in ``values``.
    """

    name: str
    ebits: int
    mbits: int
    bias: int

    @property
    def values(self) -> tuple[float, ...]:
        """The 8 magnitudes in code order: subnormals (exponent field 0), then the normals."""
        out = []
        for code in range(2 ** (self.ebits + self.mbits)):
            e, m = code >> self.mbits, code & (2**self.mbits - 1)
            frac = m / 2**self.mbits
            out.append(frac * 2.0 ** (1 - self.bias) if e == 0 else (1 + frac) * 2.0 ** (e - self.bias))
        return tuple(out)

    @property
    def max(self) -> float:
        return self.values[-1]

    @property
    def emin(self) -> int:
        """The exponent of the smallest normal (subnormals share its spacing)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        return 2**self.ebits - 1 - self.bias

    @property
    def sign_bit(self) -> int:
        return 1 << (self.ebits + self.mbits)


#: E2M1, the NVFP4 / MXFP4 element: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1 = Fp4Format("e2m1", ebits=2, mbits=1, bias=1)


def get_format(fmt: str | Fp8Format) -> Fp8Format:
    """Look up a format by name (``"e4m3"`` or ``"e5m2"``)."""
    if isinstance(fmt, Fp8Format):
        return fmt
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown FP8 format {fmt!r}; expected one of {sorted(FORMATS)}") from None


_MANTISSA_BITS_FP32 = 23
_EXPONENT_BIAS_FP32 = 127
_SIGN_BIT = -(2**31)  # 0x80000000 as int32


@dataclass(frozen=True)
class BitLayout:
    """The integer constants of one FP8 format's bit layout, as integer kernels use them (the CPU
    backend ``fast_emulated`` and its C loop): derived from ``torch.finfo``."""

    exponent_floor: int  # fp32 exponent bits of the smallest normal, 2 ** emin
    magic_offset: int  # (23 - mbits) << 23: adds 23 - mbits to an fp32 exponent
    shift: int  # 23 - mbits: where the FP8 exponent+mantissa bits sit in an fp32 pattern
    decode_mask: int  # sign | exponent+mantissa field, after shifting the byte left by 23 - mbits
    decode_factor: float  # 2 ** (127 - bias): turns the shifted pattern into the FP8 value
    magnitude: int  # the 7 bits of a code below its sign bit
    nonfinite_magnitude: int  # the smallest magnitude that is inf or NaN
    mbits: int  # mantissa bits
    bias: int  # exponent bias


@cache
def _bit_layout(dtype: torch.dtype, has_inf: bool) -> BitLayout:
    info = torch.finfo(dtype)
    mbits = -int(math.log2(info.eps))
    emin = int(math.log2(info.smallest_normal))
    shift = _MANTISSA_BITS_FP32 - mbits
    ebits = info.bits - 1 - mbits
    bias = 2 ** (ebits - 1) - 1
    magnitude = 2 ** (info.bits - 1) - 1  # the 7 bits below the sign
    # E4M3 (fn): only the all-ones magnitude is NaN; E5M2: the all-ones exponent is inf/NaN
    nonfinite = magnitude if not has_inf else ((2**ebits - 1) << mbits)
    return BitLayout(
        exponent_floor=(emin + _EXPONENT_BIAS_FP32) << _MANTISSA_BITS_FP32,
        magic_offset=shift << _MANTISSA_BITS_FP32,
        shift=shift,
        decode_mask=_SIGN_BIT | (magnitude << shift),
        decode_factor=2.0 ** (_EXPONENT_BIAS_FP32 - bias),
        magnitude=magnitude,
        nonfinite_magnitude=nonfinite,
        mbits=mbits,
        bias=bias,
    )


def bit_layout(fmt: str | Fp8Format) -> BitLayout:
    """The :class:`BitLayout` of a format (computed once per format)."""
    f = get_format(fmt)
    return _bit_layout(f.dtype, f.has_inf)
