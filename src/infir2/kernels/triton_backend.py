"""The ``triton`` backend: Triton quantization and Triton block-scaled GEMMs for the blockwise casts.

Quantization (``triton_quant``, bit-identical to the reference) takes the (1,128), (128,1) and
(128,128) blocks with fp32 or power-of-two scales, and quantizes the (1,128) and (128,1) copies of
one tensor from a single read (``quantize_pair``). The GEMM (``triton_gemm``) takes operands whose
blocks are 1 or 128 rows by 128 along K, any shape. Everything else (rowwise, tensorwise, MX blocks,
E8M0 scales) is declined and runs on the next backend of the chain.

It needs CUDA, an SM89+ GPU (FP8 tensor cores) and the ``triton`` package; the Triton modules are
imported on first use, so importing ``infir2`` never needs Triton.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from ..fp8.formats import BLOCK, get_format
from ..fp8.quantize import amax_to_scale, resolve_block
from ..fp8.recipe import Cast, Fp8Recipe
from .operand import Operand

__all__ = [
    "NAME",
    "gemm_nt",
    "quantize",
    "quantize_pair",
    "quantize_with_amax",
    "supports_gemm",
    "supports_quantize",
    "takes_shard",
    "why_unavailable",
]

NAME = "triton"
_ROW_TILE, _TOKEN_TILE = (1, BLOCK), (BLOCK, 1)
_BLOCKS = (_ROW_TILE, _TOKEN_TILE, (BLOCK, BLOCK))


def why_unavailable(recipe: Fp8Recipe, device: torch.device) -> str | None:
    if not any(c.scale_encoding != "e8m0" and tuple(c.block) in _BLOCKS for c in recipe.casts.values()):
        return f"the Triton kernels implement blockwise casts {_BLOCKS}; recipe {recipe.name!r} has none"
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "FP8 tensor cores need an SM89+ GPU"
    return None


@functools.cache
def _runs_on(device: torch.device) -> bool:
    """CUDA, the triton package and FP8 tensor cores (asked once per device)."""
    return (
        device.type == "cuda"
        and importlib.util.find_spec("triton") is not None
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )


def takes_shard(x: torch.Tensor, cast: Cast) -> bool:
    """True when :func:`quantize_with_amax` runs ``x`` (a weight shard of FSDP2's FP8 all-gather) here."""
    return (
        x.is_cuda
        and cast.scale_encoding in ("fp32", "pow2")
        and all(b > 0 and (b == 1 or b == BLOCK) for b in cast.block)
        and _runs_on(x.device)
    )


def quantize_with_amax(
    x: torch.Tensor, amax: torch.Tensor, cast: Cast, row_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``infir2.fp8.quantize_with_amax`` in one Triton pass: rows ``row_offset ..`` of a matrix whose
    block ``amax`` is given; returns ``(data, scale_inv)`` with the whole matrix's ``scale_inv``."""
    from . import triton_quant

    scale = amax_to_scale(amax, get_format(cast.fmt), cast.scale_encoding)  # [Nb, Kb]: a few KB
    return triton_quant.quantize_with_scale(x, scale, cast.block, cast.fmt, row_offset), scale.reciprocal()


def supports_quantize(x: torch.Tensor, cast: Cast) -> bool:
    from . import triton_quant

    return (
        x.is_cuda
        and cast.scale_encoding in ("fp32", "pow2")
        and triton_quant.supports_block(cast.block, x.shape)
    )


def quantize(x: torch.Tensor, cast: Cast) -> Operand:
    from . import triton_quant

    data, scale_inv = triton_quant.quantize(x, cast.block, cast.fmt, cast.scale_encoding)
    return Operand(data, scale_inv, cast.block)


def quantize_pair(x: torch.Tensor, a: Cast, b: Cast) -> tuple[Operand, Operand]:
    """The (1,128) and (128,1) copies of ``x`` from one read (one kernel); other pairs: two calls."""
    from . import triton_quant

    blocks = (resolve_block(a.block, x.shape), resolve_block(b.block, x.shape))
    if (
        a.fmt == b.fmt
        and a.scale_encoding == b.scale_encoding
        and blocks in ((_ROW_TILE, _TOKEN_TILE), (_TOKEN_TILE, _ROW_TILE))
    ):
        row, col = triton_quant.quantize_both(x, a.fmt, a.scale_encoding)
        ops = Operand(*row, _ROW_TILE), Operand(*col, _TOKEN_TILE)
        return ops if blocks[0] == _ROW_TILE else (ops[1], ops[0])
    return quantize(x, a), quantize(x, b)


def supports_gemm(a: Operand, b: Operand, out_dtype: torch.dtype) -> bool:
    from . import triton_gemm

    fp32_scales = a.scale_inv.dtype == torch.float32
    return fp32_scales and a.data.is_cuda and triton_gemm.supports_operands(a, b)


def gemm_nt(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b [N, K].T`` with the Triton block-scaled GEMM."""
    from . import triton_gemm

    return triton_gemm.gemm_nt(a, b, out_dtype)
