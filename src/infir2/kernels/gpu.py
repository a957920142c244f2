"""The GPU backends of the blockwise recipe: Triton quantization + cuBLAS or Triton block-scaled GEMMs.

Two backends share the Triton quantization kernels (``triton_quant``, bit-identical to the
reference) and differ in the GEMM:

* ``cuda``   - ``torch.nn.functional.scaled_mm`` with block scales (cuBLAS, SM90 and CUDA >= 12.9)
  for every GEMM it can take, the Triton GEMM for the rest (other GPUs, shapes that are not multiples
  of 128/16). The preferred backend for the blockwise recipe on a GPU.
* ``triton`` - the Triton block-scaled GEMM for everything (portable; useful to compare).

Both need CUDA, an SM89+ GPU (FP8 tensor cores) and the ``triton`` package; where any is missing
``select_backend`` logs why and picks the next backend (``scaled_mm`` / ``emulated``). Block
shapes the Triton kernels do not implement (rowwise, tensorwise) use the reference quantizer and
the emulated GEMM, logged once. The Triton modules are imported on first use, so importing
``infir2`` never needs Triton.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from .._logging import log_once
from ..fp8.quantize import Block
from ..fp8.quantize import quantize as reference_quantize
from ..fp8.recipe import Fp8Recipe
from . import scaled_mm
from .operand import Operand

__all__ = [
    "gemm_nt_cublas_or_triton",
    "gemm_nt_triton",
    "gpu_unavailable",
    "quantize_operand",
    "supports_operands",
]

log = logging.getLogger(__name__)
_cublas_failed: set[tuple[str, str, torch.dtype]] = set()


def gpu_unavailable(recipe: Fp8Recipe, device: torch.device) -> str | None:
    """Why the ``cuda`` / ``triton`` backends cannot run ``recipe`` on ``device`` (None when they can)."""
    if recipe.granularity != "blockwise":
        return (
            f"the Triton kernels implement blockwise scales; recipe {recipe.name!r} is {recipe.granularity}"
        )
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "FP8 tensor cores need an SM89+ GPU"
    return None


def quantize_operand(x: torch.Tensor, block: Block, fmt: str, pow2_scale: bool) -> Operand:
    """Triton quantization for (1,128), (128,1), (128,128) blocks; the reference for other blocks."""
    from . import triton_quant

    if triton_quant.supports_block(block, x.shape):
        data, scale_inv = triton_quant.quantize(x, block, fmt, pow2_scale)
    else:
        log_once(
            log, f"triton quantize has no kernel for block {tuple(block)}; using the reference quantizer"
        )
        data, scale_inv = reference_quantize(x, block, fmt, pow2_scale)
    return Operand(data, scale_inv, tuple(block))  # type: ignore[arg-type]


def quantize_operand_pair(
    x: torch.Tensor, block_a: Block, block_b: Block, fmt: str, pow2_scale: bool
) -> tuple[Operand, Operand]:
    """The (1,128) and (128,1) copies of ``x`` from one read (one Triton kernel); other pairs: two calls."""
    from ..fp8.formats import BLOCK
    from . import triton_quant

    pair = (tuple(block_a), tuple(block_b))
    if pair in (((1, BLOCK), (BLOCK, 1)), ((BLOCK, 1), (1, BLOCK))):
        row, col = triton_quant.quantize_both(x, fmt, pow2_scale)
        ops = Operand(*row, (1, BLOCK)), Operand(*col, (BLOCK, 1))
        return ops if pair[0] == (1, BLOCK) else (ops[1], ops[0])
    return quantize_operand(x, block_a, fmt, pow2_scale), quantize_operand(x, block_b, fmt, pow2_scale)


def supports_operands(a: Operand, b: Operand) -> bool:
    from . import triton_gemm

    return triton_gemm.supports_operands(a, b)


def gemm_nt_triton(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b [N, K].T`` with the Triton block-scaled GEMM."""
    from . import triton_gemm

    return triton_gemm.gemm_nt(a, b, out_dtype)


def gemm_nt_cublas_or_triton(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b [N, K].T`` with cuBLAS block-scaled ``scaled_mm`` where it runs, else Triton."""
    key = (str(a.block), str(b.block), out_dtype)
    reason = scaled_mm.blockwise_unavailable(a.data.device)
    if reason:
        log_once(log, f"cuBLAS blockwise GEMM unavailable ({reason}); the Triton GEMM runs instead")
    elif key not in _cublas_failed and scaled_mm.supports_blockwise(a, b):
        try:
            return scaled_mm.gemm_nt_blockwise(a, b, out_dtype)
        except (RuntimeError, NotImplementedError) as e:  # a cuBLAS build/driver that refuses this case
            _cublas_failed.add(key)
            log.warning("cuBLAS blockwise GEMM %s x %s -> %s failed (%s); using the Triton GEMM for it",
                        a.block, b.block, out_dtype, str(e).splitlines()[0])  # fmt: skip
    return gemm_nt_triton(a, b, out_dtype)
