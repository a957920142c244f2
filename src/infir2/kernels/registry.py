"""GEMM + quantize backends behind one contract, and the automatic choice between them.

A backend provides ``quantize(x, block, fmt, pow2_scale) -> Operand`` and
``gemm_nt(a, b, out_dtype) -> a @ b.T``. ``emulated`` is the reference and takes everything; a
faster backend may decline a particular pair of operands (``supports``), in which case that GEMM
runs emulated and the fallback is logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._logging import log_once
from ..fp8.quantize import Block
from ..fp8.recipe import Fp8Recipe
from . import compiled, emulated, gpu, scaled_mm
from .operand import Operand

__all__ = ["BACKENDS", "Backend", "register_backend", "select_backend"]

log = logging.getLogger(__name__)

QuantizeFn = Callable[[torch.Tensor, tuple[int, int], str, bool], Operand]
GemmFn = Callable[[Operand, Operand, torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class Backend:
    name: str
    quantize: QuantizeFn
    gemm_nt_fn: GemmFn
    supports: Callable[[Operand, Operand], bool] = lambda a, b: True
    available: Callable[[Fp8Recipe, torch.device], str | None] = lambda recipe, device: None
    #: optional: both tilings of one tensor from one read, ``(x, block_a, block_b, fmt, pow2) -> (a, b)``
    quantize_pair: Callable[[torch.Tensor, Block, Block, str, bool], tuple[Operand, Operand]] | None = None

    def quantize_both(
        self, x: torch.Tensor, block_a: Block, block_b: Block, fmt: str, pow2_scale: bool
    ) -> tuple[Operand, Operand]:
        """``(quantize(x, block_a), quantize(x, block_b))``, fused when the backend can."""
        if self.quantize_pair is not None:
            return self.quantize_pair(x, block_a, block_b, fmt, pow2_scale)
        return self.quantize(x, block_a, fmt, pow2_scale), self.quantize(x, block_b, fmt, pow2_scale)

    def gemm_nt(self, a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
        if self.supports(a, b):
            return self.gemm_nt_fn(a, b, out_dtype)
        log_once(
            log,
            f"backend {self.name} cannot take blocks {a.block} x {b.block} with shapes "
            f"{tuple(a.shape)} x {tuple(b.shape)}; that GEMM runs emulated",
        )
        return emulated.gemm_nt(a, b, out_dtype)


def _scaled_mm_available(recipe: Fp8Recipe, device: torch.device) -> str | None:
    if recipe.granularity == "blockwise":
        return "torch._scaled_mm takes tensorwise and rowwise scales; blockwise needs another backend"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return "FP8 GEMMs need an SM89+ GPU"
    if device.type not in ("cpu", "cuda"):
        return f"torch._scaled_mm does not run on {device.type}"
    return None


BACKENDS: dict[str, Backend] = {
    "emulated": Backend("emulated", emulated.quantize_operand, emulated.gemm_nt),
    "scaled_mm": Backend(
        "scaled_mm",
        emulated.quantize_operand,
        scaled_mm.gemm_nt,
        scaled_mm.supports_operands,
        _scaled_mm_available,
    ),
    # Triton quantization + cuBLAS block-scaled GEMMs (SM90, CUDA >= 12.9), Triton GEMMs elsewhere.
    "cuda": Backend(
        "cuda",
        gpu.quantize_operand,
        gpu.gemm_nt_cublas_or_triton,
        gpu.supports_operands,
        gpu.gpu_unavailable,
        gpu.quantize_operand_pair,
    ),
    # Triton quantization + Triton block-scaled GEMMs everywhere.
    "triton": Backend(
        "triton",
        gpu.quantize_operand,
        gpu.gemm_nt_triton,
        gpu.supports_operands,
        gpu.gpu_unavailable,
        gpu.quantize_operand_pair,
    ),
    # The emulated backend with torch.compile'd quantize/dequantize; only when asked for (compile time).
    "compiled": Backend(
        "compiled", compiled.quantize_operand, compiled.gemm_nt, available=compiled.compiled_unavailable
    ),
}

#: Preference order for automatic selection: the first available backend wins. ``compiled`` is not
#: in it: it is faster per call on CPU but costs compile time, so it runs only when asked for.
PREFERENCE: list[str] = ["cuda", "triton", "scaled_mm", "emulated"]

#: select_backend's answers: it runs on every forward, so the device queries are done once.
_selected: dict[tuple[Fp8Recipe, torch.device, str | None], Backend] = {}


def register_backend(backend: Backend, prefer: bool = True) -> None:
    """Add a backend; with ``prefer`` it is tried before the existing ones."""
    BACKENDS[backend.name] = backend
    _selected.clear()
    if backend.name in PREFERENCE:
        PREFERENCE.remove(backend.name)
    PREFERENCE.insert(0 if prefer else len(PREFERENCE) - 1, backend.name)


def select_backend(recipe: Fp8Recipe, device: torch.device | str, override: str | None = None) -> Backend:
    """The backend for ``recipe`` on ``device``: ``override`` if given (an error if it cannot run), else
    the first available one in preference order. The choice is logged once."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (recipe, device, override)
    cached = _selected.get(key)
    if cached is not None and BACKENDS.get(cached.name) is cached:  # still registered (tests swap them)
        return cached
    if override is not None:
        if override not in BACKENDS:
            raise ValueError(f"unknown FP8 backend {override!r}; known backends: {', '.join(BACKENDS)}")
        reason = BACKENDS[override].available(recipe, device)
        if reason:
            raise ValueError(
                f"FP8 backend {override!r} cannot run recipe {recipe.name!r} on {device}: {reason}"
            )
        chosen, why = BACKENDS[override], "requested"
    else:
        reasons = {}
        for name in PREFERENCE:
            reasons[name] = BACKENDS[name].available(recipe, device)
            if reasons[name] is None:
                chosen, why = BACKENDS[name], "automatic"
                break
        skipped = "; ".join(f"{n}: {r}" for n, r in reasons.items() if r)
        why = f"automatic{' (' + skipped + ')' if skipped else ''}"
    log_once(log, f"FP8 recipe {recipe.name!r} on {device.type}: backend {chosen.name} [{why}]")
    _selected[key] = chosen
    return chosen
