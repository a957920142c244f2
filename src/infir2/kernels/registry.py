"""The backends, their one fallback order, and the dispatcher an ``Fp8Linear`` is bound to.

Every backend is a module implementing :class:`Backend` (a handful of functions: can it run here,
which casts and operand pairs it takes, quantize, GEMM). ``emulated`` takes everything and ends
every chain. ``bind(recipe, device, override)`` returns :class:`Kernels`: the backends usable for
that recipe on that device, in the order of ``ORDER`` (a requested backend first). Each quantization and each GEMM goes to the
first backend of the chain that supports it; a job that skips the first backend is logged once
(which job, which backend took it), and a backend that raises on a job it claimed is logged as a
warning and passed over for that kind of job from then on. There is no other fallback anywhere.

``convert_to_fp8`` binds each ``Fp8Linear`` once; the layer binds again only when its input arrives
on another device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .._logging import log_once
from ..fp8.recipe import Cast, Fp8Recipe
from . import compiled, emulated, fast_emulated, scaled_mm, triton_backend
from .operand import Operand

__all__ = ["BACKENDS", "ORDER", "Backend", "Kernels", "bind"]

log = logging.getLogger(__name__)


class Backend(Protocol):
    """What a backend module provides (see ``kernels/emulated.py`` for the reference one)."""

    NAME: str

    def why_unavailable(self, recipe: Fp8Recipe, device: torch.device) -> str | None:
        """None when the backend can serve ``recipe`` on ``device``, else the reason it cannot."""
        ...

    def supports_quantize(self, x: torch.Tensor, cast: Cast) -> bool: ...

    def quantize(self, x: torch.Tensor, cast: Cast) -> Operand: ...

    def quantize_pair(self, x: torch.Tensor, a: Cast, b: Cast) -> tuple[Operand, Operand]:
        """``(quantize(x, a), quantize(x, b))``, from one read of ``x`` where the backend can fuse it."""
        ...

    def supports_gemm(self, a: Operand, b: Operand, out_dtype: torch.dtype) -> bool: ...

    def gemm_nt(self, a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
        """``a [M, K] @ b [N, K].T -> [M, N]``, fp32 accumulation, in ``out_dtype``."""
        ...


BACKENDS: dict[str, Backend] = {
    m.NAME: m for m in (emulated, fast_emulated, scaled_mm, triton_backend, compiled)
}

#: The fallback order per device type; the first backend that takes a job runs it. ``compiled`` is in
#: no chain: it is faster per call on a CPU but costs compile time, so it runs only when asked for.
ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("scaled_mm", "triton", "emulated"),  # cuBLAS (FP8 / block-scaled), Triton, reference
    # On a CPU the exact emulation (C kernel) runs tensorwise / rowwise 2-3x faster than torch's CPU
    # _scaled_mm, which converts FP8 back element by element; scaled_mm stays in the chain.
    "cpu": ("fast_emulated", "scaled_mm", "emulated"),
}


@dataclass
class Kernels:
    """The chain of backends bound to one recipe on one device; runs each job on the first that takes it."""

    recipe: Fp8Recipe
    device: torch.device
    chain: tuple[Backend, ...]
    _broken: set[tuple[str, str]] = field(default_factory=set)  # (backend, job) that raised

    @property
    def name(self) -> str:
        """The preferred backend (the first of the chain)."""
        return self.chain[0].NAME

    def __deepcopy__(self, memo: dict[int, Any]) -> Kernels:
        return self  # backends are modules; a copied layer shares its binding

    def _first(self, takes: Callable[[Backend], bool], describe: Callable[[], str]) -> Backend:
        """The first backend of the chain that ``takes`` the job. ``describe`` names the job without
        shapes (a fallback is logged once per kind of job); it is only called off the fast path."""
        for backend in self.chain:
            if not takes(backend) or (self._broken and (backend.NAME, describe()) in self._broken):
                continue
            if backend is not self.chain[0]:
                log_once(
                    log, f"FP8 {describe()}: {self.chain[0].NAME} does not take it; runs on {backend.NAME}"
                )
            return backend
        raise AssertionError("no backend takes the job; the emulated backend ends every chain")

    def quantize(self, x: torch.Tensor, cast: Cast) -> Operand:
        backend = self._first(
            lambda be: be.supports_quantize(x, cast),
            lambda: f"quantize {tuple(cast.block)} {cast.fmt}/{cast.scale_encoding}",
        )
        return backend.quantize(x, cast)

    def quantize_pair(self, x: torch.Tensor, a: Cast, b: Cast) -> tuple[Operand, Operand]:
        backend = self._first(
            lambda be: be.supports_quantize(x, a) and be.supports_quantize(x, b),
            lambda: f"quantize {tuple(a.block)} + {tuple(b.block)} {a.fmt}/{a.scale_encoding}",
        )
        return backend.quantize_pair(x, a, b)

    def gemm_nt(self, a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
        def describe() -> str:
            return f"GEMM {tuple(a.block)} x {tuple(b.block)} -> {out_dtype}"

        while True:
            backend = self._first(lambda be: be.supports_gemm(a, b, out_dtype), describe)
            if backend.NAME == emulated.NAME:  # the reference: its errors are real errors
                return backend.gemm_nt(a, b, out_dtype)
            try:
                return backend.gemm_nt(a, b, out_dtype)
            except (RuntimeError, NotImplementedError) as e:  # e.g. a cuBLAS build that refuses the case
                self._broken.add((backend.NAME, describe()))
                log.warning("FP8 %s failed on %s (%s); the next backend runs it from now on",
                            describe(), backend.NAME, str(e).splitlines()[0] if str(e) else type(e).__name__)  # fmt: skip


def _resolve_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def bind(recipe: Fp8Recipe, device: torch.device | str, override: str | None = None) -> Kernels:
    """The :class:`Kernels` of ``recipe`` on ``device``: every usable backend of ``ORDER`` (then
    ``emulated``), with ``override`` moved to the front when one is named (an error if it cannot run
    here). The chain is logged once."""
    device = _resolve_device(device)
    if override is not None:
        if override not in BACKENDS:
            raise ValueError(f"unknown FP8 backend {override!r}; known backends: {', '.join(BACKENDS)}")
        reason = BACKENDS[override].why_unavailable(recipe, device)
        if reason:
            raise ValueError(
                f"FP8 backend {override!r} cannot run recipe {recipe.name!r} on {device}: {reason}"
            )
    names = [override] if override is not None else []
    skipped = []
    for name in (*ORDER.get(device.type, ()), emulated.NAME):
        if name in names:
            continue
        if names[-1:] == [emulated.NAME]:
            break  # emulated takes every job: nothing after it would run
        reason = BACKENDS[name].why_unavailable(recipe, device)
        if reason:
            skipped.append(f"{name}: {reason}")
        else:
            names.append(name)
    why = "requested first" if override else "automatic"
    why += f" ({'; '.join(skipped)})" if skipped else ""
    log_once(log, f"FP8 recipe {recipe.name!r} on {device.type}: backends {' > '.join(names)} [{why}]")
    return Kernels(recipe, device, tuple(BACKENDS[n] for n in names))
