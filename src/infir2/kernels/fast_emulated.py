"""Fast CPU emulation: decode FP8 with integer arithmetic, keep an activation's dequantized copy for its GEMM.

Same contract as the reference (``infir2.fp8.quantize``), bit for bit: ``data`` and ``scale_inv``
are identical to ``quantize(x, block, fmt, scale_encoding)`` and ``dequantized`` to
``dequantize(data, scale_inv, block)``, so a GEMM on the dequantized operands is the ``emulated``
backend's GEMM. What changes is the cost. On a CPU the slowest step of the reference is the
fp8 -> fp32 conversion inside ``dequantize``: torch converts FP8 one element at a time (~15 ns per
element on the development CPU, ~100x an fp32 multiply), and the emulated backend pays it for
every operand of every GEMM. Here torch never converts FP8 back:

1. **Scale.** ``amax`` per block over a view of ``x`` (no padding copy when the shape is whole
   blocks), ``scale = amax_to_scale(amax)`` - the reference's own function, so any change to the
   scale rule applies here too.
2. **Round.** ``data = clamp(x * scale, -fmax, fmax).to(fp8)``: the reference's multiply and its
   saturating round-to-nearest-even cast, the same torch operations, so the same bytes.
3. **Decode in fp32 bit arithmetic.** An FP8 byte is a sign, ``ebits`` exponent and ``mbits``
   mantissa bits; shifted left by ``23 - mbits`` into an fp32 pattern it lands on the fp32
   sign/exponent/mantissa fields, with the exponent bias off by ``127 - bias``::

       bits  = (int32(int8(data)) << (23 - mbits)) & (sign bit | 7 magnitude bits << (23 - mbits))
       value = float32(bits) * 2 ** (127 - bias)

   The multiply by a power of two is exact, and an FP8 subnormal (exponent field 0) becomes an fp32
   subnormal with the same mantissa, which the same multiply scales exactly. So ``value`` is
   ``data.float()`` bit for bit, and ``dequantized = value * scale_inv`` is the reference's one
   rounding of the same product; the power of two is folded into ``scale_inv`` when that product
   is finite (it then is exact), so decoding costs an int8 -> int32 widening, two integer ops and
   the multiply the reference does anyway.

Non-finite inputs (a block whose ``amax`` is NaN or inf; one check of the small ``amax`` tensor) and
FP8 bytes that encode NaN/inf take the reference path, so NaN stays NaN, inf becomes NaN in E4M3 and
stays inf in E5M2, with the reference's exact bit patterns and NaN payloads.

**The C kernel.** Where a C compiler exists, steps 1-3 run as one call into ``kernels.native``
(``csrc/fp8_emulation.c``): the same arithmetic in two vectorized loops, with the rounding done in
fp32 by a magic-number addition (``(|y| + 2 ** (e + 23 - mbits)) - 2 ** (...)``, exact) instead of
the cast, and the byte computed from the rounded value. The eager torch code above is what runs
without a compiler (or with ``INFIR2_NATIVE=0``); both are tested against the reference.

Cost (``benchmarks/cpu_emulation.py``): the C kernel quantizes 7-14x faster than the reference's
quantize + dequantize; the eager code ~2x (~8 elementwise passes plus the fp32 -> fp8 cast); the
GEMMs on kept operands are the fp32 GEMMs of ``nn.Linear``. Memory: ``dequantized`` is an fp32
copy of the operand. It is kept only while its GEMM needs it (an activation's first tiling, made by
:func:`quantize_pair` just before its GEMM); a weight (:func:`quantize`, held by the weight cache
all step) keeps its FP8 bytes only, and each GEMM decodes them, as backward does with the saved FP8
``data``: :func:`dequantize` brings it back at the cost of one decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..fp8.formats import BitLayout, Fp8Format, bit_layout, get_format
from ..fp8.quantize import Block, ScaleEncoding, amax_to_scale, check_quantize_input, resolve_block
from ..fp8.quantize import dequantize as reference_dequantize
from ..fp8.quantize import quantize as reference_quantize
from ..fp8.recipe import Cast, Fp8Recipe
from . import native
from .operand import Operand

__all__ = [
    "NAME",
    "KeptOperand",
    "dequantize",
    "gemm_nt",
    "gemm_nt_fp32",
    "quantize",
    "quantize_fp8",
    "quantize_kept",
    "quantize_kept_operand",
    "quantize_pair",
    "supports_gemm",
    "supports_quantize",
    "why_unavailable",
]

NAME = "fast_emulated"


def _decode(codes: torch.Tensor, scale_inv: torch.Tensor, g: BitLayout) -> torch.Tensor:
    """fp32 ``codes * scale_inv`` (``scale_inv`` broadcast to ``codes``) for finite FP8 ``codes``."""
    bits = codes.view(torch.int8).to(torch.int32).bitwise_left_shift_(g.shift).bitwise_and_(g.decode_mask)
    raw = bits.view(torch.float32)  # the FP8 value times 2 ** -(127 - bias), exact
    factor = scale_inv.float() * g.decode_factor
    if math.isfinite(factor.max()):  # exact, so raw * factor is one rounding of value * scale_inv
        return raw.mul_(factor)
    return raw.mul_(g.decode_factor).mul_(scale_inv.float())


class _Blocks:
    """``x [M, K]`` viewed so that each block is one reduction: ``[M, Kb, bk]`` for ``(1, bk)``,
    ``[Mb, bm, K]`` for ``(bm, 1)``, else ``[Mb, bm, Kb, bk]``; zero-padded only for partial blocks."""

    def __init__(self, x: torch.Tensor, block: Block) -> None:
        self.m, self.k = x.shape
        self.bm, self.bk = resolve_block(block, x.shape)
        pad_m, pad_k = (-self.m) % self.bm, (-self.k) % self.bk
        if pad_m or pad_k:
            x = F.pad(x, (0, pad_k, 0, pad_m))
        self.padded_shape = x.shape
        self.mb, self.kb = x.shape[0] // self.bm, x.shape[1] // self.bk
        self.dims: tuple[int, ...]  # the dimensions of self.view that one block spans
        if self.bm == 1:
            self.view, self.dims = x.reshape(x.shape[0], self.kb, self.bk), (2,)
        elif self.bk == 1:
            self.view, self.dims = x.reshape(self.mb, self.bm, x.shape[1]), (1,)
        else:
            self.view, self.dims = x.reshape(self.mb, self.bm, self.kb, self.bk), (1, 3)

    def per_block(self, s: torch.Tensor) -> torch.Tensor:
        """A ``[Mb, Kb]`` tensor broadcast against :attr:`view`."""
        if self.bm == 1:
            return s[:, :, None]
        if self.bk == 1:
            return s[:, None, :]
        return s[:, None, :, None]

    def unview(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like :attr:`view` back to ``[M, K]`` (a slice when padded)."""
        t = t.reshape(self.padded_shape)
        return t if tuple(t.shape) == (self.m, self.k) else t[: self.m, : self.k]


def _quantize_blocks(
    x: torch.Tensor, block: Block, f: Fp8Format, scale_encoding: ScaleEncoding
) -> tuple[_Blocks, torch.Tensor, torch.Tensor] | None:
    """``(blocks, codes in the blocks' view, scale_inv)``; ``None`` where the reference must run."""
    check_quantize_input(x)
    if x.dtype == torch.float64 or x.numel() == 0:  # fp64 input rounds differently in x.float()
        return None
    b = _Blocks(x, block)
    amax = b.view.abs().amax(dim=b.dims)  # [Mb, Kb], exact in x's dtype
    if not math.isfinite(amax.max()):  # inf/NaN somewhere (max propagates NaN): the reference's bits
        return None
    scale = amax_to_scale(amax, f, scale_encoding)  # [Mb, Kb] fp32
    y = b.view * b.per_block(scale)  # fp32 (bf16 * fp32 promotes exactly like x.float() * scale)
    codes = y.clamp_(-f.max, f.max).to(f.dtype)  # the reference's saturating RNE cast (y is finite)
    return b, codes, scale.reciprocal()


def _native(
    x: torch.Tensor, block: Block, f: Fp8Format, scale_encoding: ScaleEncoding, kept: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The C kernel's result (``kernels.native``), or ``None`` where the eager code runs."""
    check_quantize_input(x)
    if scale_encoding not in ("fp32", "pow2"):
        raise ValueError(f"fast_emulated quantizes with fp32 or pow2 scales, got {scale_encoding!r}")
    if x.dtype != torch.float32:
        return None
    bm, bk = resolve_block(block, x.shape)
    return native.quantize(x, bm, bk, f.max, scale_encoding, bit_layout(f), f.dtype, kept)


def quantize_fp8(
    x: torch.Tensor, block: Block, fmt: str = "e4m3", scale_encoding: ScaleEncoding = "pow2"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data [M,K] fp8, scale_inv [Mb,Kb] fp32)``, bit-identical to the reference ``quantize``."""
    f = get_format(fmt)
    fast = _native(x, block, f, scale_encoding, kept=False)
    if fast is not None:
        return fast[0], fast[1]
    quantized = _quantize_blocks(x, block, f, scale_encoding)
    if quantized is None:
        return reference_quantize(x, block, fmt, scale_encoding)
    b, codes, scale_inv = quantized
    return b.unview(codes).contiguous(), scale_inv


def quantize_kept(
    x: torch.Tensor, block: Block, fmt: str = "e4m3", scale_encoding: ScaleEncoding = "pow2"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data [M,K] fp8, scale_inv [Mb,Kb] fp32, dequantized [M,K] fp32)``, bit-identical to the
    reference ``quantize`` and to ``dequantize(data, scale_inv, block)``."""
    f = get_format(fmt)
    fast = _native(x, block, f, scale_encoding, kept=True)
    if fast is not None:
        return fast  # type: ignore[return-value]  # kept=True: the dequantized copy is there
    quantized = _quantize_blocks(x, block, f, scale_encoding)
    if quantized is None:
        data, scale_inv = reference_quantize(x, block, fmt, scale_encoding)
        return data, scale_inv, reference_dequantize(data, scale_inv, block)
    b, codes, scale_inv = quantized  # codes are finite: decode them directly
    dequantized = b.unview(_decode(codes, b.per_block(scale_inv), bit_layout(f)))
    return b.unview(codes).contiguous(), scale_inv, dequantized


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, block: Block) -> torch.Tensor:
    """``data * scale_inv`` in fp32, bit-identical to the reference ``dequantize``, decoding the FP8
    bytes with integer operations instead of torch's element-by-element conversion."""
    if data.dim() != 2 or data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"dequantize expects 2-D FP8 data, got {data.dtype} of shape {tuple(data.shape)}")
    f = get_format("e4m3" if data.dtype == torch.float8_e4m3fn else "e5m2")
    g = bit_layout(f)
    bm, bk = resolve_block(block, data.shape)
    blocks = (-(-data.shape[0] // bm), -(-data.shape[1] // bk))
    if scale_inv.shape != blocks:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match data {tuple(data.shape)} "
            f"with block {tuple(block)}: expected {blocks}"
        )
    if not data.is_contiguous() and data.t().is_contiguous():  # a transposed view: decode it in place
        return dequantize(data.t(), scale_inv.t(), (block[1], block[0])).t()
    fast = native.decode(data, scale_inv, bm, bk, g)
    if fast is not None:
        return fast
    b = _Blocks(data.view(torch.int8), block)  # a view of the bytes (reshape, as the reference does)
    if data.numel() and int((data.view(torch.uint8) & g.magnitude).amax()) >= g.nonfinite_magnitude:
        return reference_dequantize(data, scale_inv, block)  # NaN/inf bytes: torch's own NaN payloads
    return b.unview(_decode(b.view, b.per_block(scale_inv), g))


def gemm_nt_fp32(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b[N, K].T -> [M, N]`` on dequantized fp32 operands, cast to ``out_dtype``."""
    assert a.shape[1] == b.shape[1], f"reduction dims differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a @ b.t()).to(out_dtype)  # [M,K] @ [K,N] -> [M,N], fp32


@dataclass(frozen=True)
class KeptOperand(Operand):
    """An :class:`Operand` that also carries its dequantized fp32 values (``None``: decode on use)."""

    dequantized: torch.Tensor | None = None

    def t(self) -> KeptOperand:
        deq = None if self.dequantized is None else self.dequantized.t()
        return KeptOperand(self.data.t(), self.scale_inv.t(), (self.block[1], self.block[0]), deq)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.dequantized is not None:
            return self.dequantized.to(dtype)
        return dequantize(self.data, self.scale_inv, self.block).to(dtype)

    @property
    def keep_for_backward(self) -> bool:
        """Kept whole when it carries its fp32 values (backward then skips decoding them again); a
        weight from :func:`quantize` carries none, so backward saves its FP8 bytes only."""
        return self.dequantized is not None

    def stored(self) -> Operand:
        """The FP8 bytes and scales only (what to save for backward)."""
        return Operand(self.data, self.scale_inv, self.block)


# --------------------------------------------------------------------------------------------
# the backend interface (infir2.kernels.registry.Backend)


def why_unavailable(recipe: Fp8Recipe, device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"the fast emulation is written for CPUs (it decodes FP8 with integer ops); got {device.type}"
    if not any(supports_cast(c) for c in recipe.casts.values()):
        return f"recipe {recipe.name!r} has only E8M0-scaled or NVFP4 casts; they run on the emulated backend"
    return None


def supports_cast(cast: Cast) -> bool:
    return cast.scale_encoding in ("fp32", "pow2") and not cast.is_fp4


def supports_quantize(x: torch.Tensor, cast: Cast) -> bool:
    return supports_cast(cast) and x.device.type == "cpu"


def quantize(x: torch.Tensor, cast: Cast) -> KeptOperand:
    """The FP8 bytes and scales of ``x``, no fp32 copy: each GEMM decodes them when it runs.

    This is how a weight is quantized, and the weight cache (``nn.cache_fp8_weights``) holds the
    result for the whole step, every layer at once: a kept fp32 copy would be 4 more bytes per weight
    beside the 1 of the codes (71 MiB per layer at the Qwen2.5-0.5B shape), above the baseline's memory.
    Decoding a weight costs one pass over its codes per GEMM (fprop, dgrad): small next to the GEMM's
    ``2 T`` multiply-adds per weight (BENCHMARKS.md, "At the Qwen2.5-0.5B width": no measurable cost).
    """
    data, scale_inv = quantize_fp8(x, cast.block, cast.fmt, cast.scale_encoding)
    return KeptOperand(data, scale_inv, cast.block)


def quantize_kept_operand(x: torch.Tensor, cast: Cast) -> KeptOperand:
    """:func:`quantize_kept` as a :class:`KeptOperand` (FP8 bytes, scales and the fp32 copy), for an
    operand whose GEMM runs now (an activation's first tiling)."""
    data, scale_inv, dequantized = quantize_kept(x, cast.block, cast.fmt, cast.scale_encoding)
    return KeptOperand(data, scale_inv, cast.block, dequantized)


def quantize_pair(x: torch.Tensor, a: Cast, b: Cast) -> tuple[KeptOperand, KeptOperand]:
    """The first tiling kept dequantized (its GEMM runs now), the second as FP8 only, decoded when its
    GEMM runs. For X the second is the wgrad copy saved for backward (only its bytes are), so forward
    never decodes it; for dY both GEMMs follow at once. With the C kernel (``kernels.native``) the
    second keeps the fp32 copy the kernel writes anyway, so dY's wgrad GEMM decodes nothing."""
    first = quantize_kept_operand(x, a)
    if native.available():  # the C kernel writes the fp32 copy anyway: keep it for dY's wgrad GEMM
        return first, quantize_kept_operand(x, b)
    data, scale_inv = quantize_fp8(x, b.block, b.fmt, b.scale_encoding)
    return first, KeptOperand(data, scale_inv, b.block)


def supports_gemm(a: Operand, b: Operand, out_dtype: torch.dtype) -> bool:
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    fp32_scales = a.scale_inv.dtype == torch.float32 and b.scale_inv.dtype == torch.float32
    return fp32_scales and a.data.dtype in fp8 and b.data.dtype in fp8 and a.data.device.type == "cpu"


def gemm_nt(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """Kept fp32 operands where present, fast decoding otherwise; the fp32 GEMM of ``emulated``."""
    return gemm_nt_fp32(_fp32(a), _fp32(b), out_dtype)  # [M,K] @ [K,N] -> [M,N], fp32


def _fp32(op: Operand) -> torch.Tensor:
    if isinstance(op, KeptOperand):
        return op.dequantize()
    return dequantize(op.data, op.scale_inv, op.block)
