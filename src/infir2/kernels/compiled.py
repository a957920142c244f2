"""The ``compiled`` backend: the emulated backend with its quantizer and dequantizer ``torch.compile``d.

On a CPU the reference quantizer makes several passes over memory (abs, amax, multiply, clamp,
where, cast); Inductor fuses them into one loop: on the development CPU the activation quantizers
run 1.7-3x faster than eager (128x128 weight blocks are not faster), bit-identical to the reference
(tested; ``BENCHMARKS.md`` has the figures). The price is compile time: ~30 s for the first graph
in a process and a few seconds for each new block shape / dtype after that, and in a whole layer
the dequantize + fp32 matmul dominates anyway. It is therefore never chosen automatically: ask for
it with ``backend="compiled"``.

The GEMM is the emulated one (dequantize to fp32, matmul) with the dequantize compiled too.

Only tensors made of whole blocks are compiled: with a partial edge block (a dimension that is not
a multiple of the block) a static-shape compile of the reference's pad + reshape + slice by torch
2.13's Inductor (CPU) wrote wrong FP8 data into the partial block ([260, 300] with 1x128 tiles, as
the first compile in a process), so those go to the eager reference, logged once.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from typing import Any

import torch

from .._logging import log_once
from ..fp8.quantize import Block, dequantize, resolve_block
from ..fp8.quantize import quantize as _reference_quantize
from ..fp8.recipe import Cast, Fp8Recipe
from .operand import Operand

__all__ = ["NAME", "gemm_nt", "quantize", "why_unavailable"]

NAME = "compiled"

log = logging.getLogger(__name__)
_cache: dict[str, Callable[..., Any]] = {}


def _compiled(name: str, fn: Callable[..., Any], shape: torch.Size, block: Block) -> Callable[..., Any]:
    """``torch.compile(fn)``, or ``fn`` itself when ``shape`` has a partial edge block (see module doc)."""
    bm, bk = resolve_block(block, shape)
    if shape[0] % bm or shape[1] % bk:
        message = (
            f"compiled backend: shape {tuple(shape)} has partial {tuple(block)} blocks; {name} runs eager"
        )
        log_once(log, message)
        return fn
    if name not in _cache:
        _cache[name] = torch.compile(fn, dynamic=True)  # shapes vary per layer: one graph, no recompiles
    return _cache[name]


def why_unavailable(recipe: Fp8Recipe, device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot run here (None when it can)."""
    if device.type == "cpu" and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "torch.compile on CPU needs a C++ compiler (c++/g++/clang++ on PATH)"
    if device.type not in ("cpu", "cuda"):
        return f"torch.compile backend not set up for {device.type}"
    if any(c.is_fp4 for c in recipe.casts.values()):
        return "the compiled quantizer is FP8 only; NVFP4 casts run on the emulated backend"
    return None


def quantize(x: torch.Tensor, cast: Cast) -> Operand:
    compiled_quantize = _compiled("quantize", _reference_quantize, x.shape, cast.block)
    data, scale_inv = compiled_quantize(x, tuple(cast.block), cast.fmt, cast.scale_encoding)
    return Operand(data, scale_inv, cast.block)


def gemm_nt(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b [N, K].T -> [M, N]``: compiled dequantize, fp32 matmul, cast to ``out_dtype``."""
    assert a.shape[1] == b.shape[1], f"reduction dims differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    a32 = _compiled("dequantize", dequantize, a.shape, a.block)(a.data, a.scale_inv, a.block)
    b32 = _compiled("dequantize", dequantize, b.shape, b.block)(b.data, b.scale_inv, b.block)
    return (a32 @ b32.t()).to(out_dtype)  # [M,K] @ [K,N] -> [M,N], fp32
