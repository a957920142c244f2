"""The backends, their one fallback order, and the dispatcher an ``Fp8Linear`` is bound to.

A backend is a module with a ``NAME`` and the functions of the jobs it does: ``quantize`` (and
``quantize_pair`` where it can fuse two tilings of one read), ``gemm_nt``, their ``supports_*``
tests and ``why_unavailable``. :class:`Backend` adapts a module to the full interface and supplies
what it leaves out: available everywhere, ``supports_quantize`` / ``supports_gemm`` true exactly when
the module has the job, and ``quantize_pair`` as two ``quantize`` calls. ``emulated`` takes every
job and ends every chain. ``bind(recipe, device, override)`` returns :class:`Kernels`: the backends
usable for that recipe on that device, in the order of ``ORDER`` (a requested backend first).

Each quantization and each GEMM goes to the first backend of the chain that supports it; a job that
skips the first backend is logged once (which job, which backend took it). A backend that raises on
a job it claimed (a cuBLAS or PyTorch check: ``RuntimeError`` / ``ValueError``; a Triton compile or
resource error: ``TritonError``) is logged as a warning and passed over for that kind of job from
then on. Three failures are never fallen back from, and are re-raised with the job and backend named:
a CUDA fault (``torch.AcceleratorError``, or a sticky error that would resurface in an unrelated
later call: detected by synchronizing the device after the failure), an out-of-memory error (the fallbacks need more memory,
not less), and errors of the emulated reference itself. There is no other fallback anywhere.

``convert_to_fp8`` binds each ``Fp8Linear`` once; the layer binds again only when its input arrives
on another device.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypeVar

import torch

from .._logging import log_once
from ..fp8.recipe import Cast, Fp8Recipe
from . import compiled, emulated, fast_emulated, scaled_mm, triton_backend
from .operand import Operand

__all__ = ["BACKENDS", "ORDER", "Backend", "Kernels", "bind"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_JOBS = ("why_unavailable", "supports_quantize", "quantize", "quantize_pair", "supports_gemm", "gemm_nt")


class Backend:
    """A backend module seen through the whole interface, with the registry's defaults for the rest.

    The module's own functions become attributes of the instance (so a test can swap one); the
    methods below are the defaults for what the module does not define.
    """

    def __init__(self, module: ModuleType | Any) -> None:
        self.NAME: str = module.NAME
        self._has_quantize = hasattr(module, "quantize")
        self._has_gemm = hasattr(module, "gemm_nt")
        for job in _JOBS:
            if hasattr(module, job):
                setattr(self, job, getattr(module, job))

    def __repr__(self) -> str:
        return f"Backend({self.NAME!r})"

    def why_unavailable(self, recipe: Fp8Recipe, device: torch.device) -> str | None:
        """None when the backend can serve ``recipe`` on ``device``, else the reason it cannot."""
        return None

    def supports_quantize(self, x: torch.Tensor, cast: Cast) -> bool:
        return self._has_quantize

    def quantize(self, x: torch.Tensor, cast: Cast) -> Operand:
        raise NotImplementedError(f"the {self.NAME} backend has no quantize")  # never claimed: see above

    def quantize_pair(self, x: torch.Tensor, a: Cast, b: Cast) -> tuple[Operand, Operand]:
        """``(quantize(x, a), quantize(x, b))``; a backend that fuses the two reads defines its own."""
        return self.quantize(x, a), self.quantize(x, b)

    def supports_gemm(self, a: Operand, b: Operand, out_dtype: torch.dtype) -> bool:
        return self._has_gemm

    def gemm_nt(self, a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
        """``a [M, K] @ b [N, K].T -> [M, N]``, fp32 accumulation, in ``out_dtype``."""
        raise NotImplementedError(f"the {self.NAME} backend has no GEMM")  # never claimed: see above


BACKENDS: dict[str, Backend] = {
    m.NAME: Backend(m) for m in (emulated, fast_emulated, scaled_mm, triton_backend, compiled)
}

#: The fallback order per device type; the first backend that takes a job runs it. ``compiled`` is in
#: no chain: it is faster per call on a CPU but costs compile time, so it runs only when asked for.
#: ``scaled_mm`` is not in the CPU chain: ``fast_emulated`` takes every GEMM it would (FP8 data, fp32
#: scales) 2-3x faster than torch's CPU ``_scaled_mm``; ``backend="scaled_mm"`` still runs it.
ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("scaled_mm", "triton", "emulated"),  # cuBLAS (FP8 / block-scaled), Triton, reference
    "cpu": ("fast_emulated", "emulated"),  # the exact emulation (C kernel where it builds), reference
}


def _is_triton_error(e: BaseException) -> bool:
    errors = sys.modules.get("triton.errors")  # imported whenever Triton can have raised
    return errors is not None and isinstance(e, errors.TritonError)


def _device_fault(device: torch.device) -> BaseException | None:
    """The sticky CUDA error the device is in, if any (a host sync: only called after a failure)."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)  # off the hot path: only after a backend raised
    except RuntimeError as fault:
        return fault
    return None


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
        return self  # backends are shared: a copied layer shares its binding

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled by backend name (modules cannot be pickled): ``torch.save(model)`` and spawned
        worker processes get the same chain back."""
        return _unpickle_kernels, (self.recipe, self.device, tuple(b.NAME for b in self.chain))

    def _first(self, takes: Callable[[Backend], bool], describe: Callable[[], str]) -> Backend:
        """The first backend of the chain that ``takes`` the job. ``describe`` names the job without
        shapes (a fallback is logged once per kind of job); it is only called off the fast path."""
        for backend in self.chain:
            if not takes(backend) or (self._broken and (backend.NAME, describe()) in self._broken):
                continue
            if backend is not self.chain[0]:
                slow = (
                    backend.NAME == emulated.NAME and self.device.type == "cuda"
                )  # loud, not slow and silent
                log_once(
                    log,
                    f"FP8 {describe()}: {self.chain[0].NAME} does not take it; runs on {backend.NAME}"
                    + (" (the plain-torch emulation, on a GPU: slower than BF16)" if slow else ""),
                    logging.WARNING if slow else logging.INFO,
                )
            return backend
        raise AssertionError("no backend takes the job; the emulated backend ends every chain")

    def _run(
        self, takes: Callable[[Backend], bool], describe: Callable[[], str], job: Callable[[Backend], T]
    ) -> T:
        """``job`` on the first backend that takes it; on a backend error, on the next one (module doc)."""
        while True:
            backend = self._first(takes, describe)
            if backend.NAME == emulated.NAME:  # the reference: its errors are real errors
                return job(backend)
            try:
                return job(backend)
            except Exception as e:
                if not isinstance(e, RuntimeError | ValueError) and not _is_triton_error(e):
                    raise  # a TypeError, an assertion...: a bug, not a case the backend declines
                where = f"FP8 {describe()} on the {backend.NAME} backend ({self.device})"
                fault = _device_fault(self.device)
                if fault is not None or isinstance(e, torch.OutOfMemoryError | torch.AcceleratorError):
                    e.add_note(
                        f"{where} failed; not retried on another backend"
                        + (f": the device is in a CUDA error state ({fault})" if fault else "")
                    )
                    raise
                self._broken.add((backend.NAME, describe()))
                first_line = str(e).splitlines()[0] if str(e) else ""
                log.warning(
                    "%s failed (%s: %s); the next backend runs it from now on",
                    where,
                    type(e).__name__,
                    first_line,
                )

    def quantize(self, x: torch.Tensor, cast: Cast) -> Operand:
        return self._run(
            lambda be: be.supports_quantize(x, cast),
            lambda: f"quantize {tuple(cast.block)} {cast.fmt}/{cast.scale_encoding}",
            lambda be: be.quantize(x, cast),
        )

    def quantize_pair(self, x: torch.Tensor, a: Cast, b: Cast) -> tuple[Operand, Operand]:
        return self._run(
            lambda be: be.supports_quantize(x, a) and be.supports_quantize(x, b),
            lambda: f"quantize {tuple(a.block)} + {tuple(b.block)} {a.fmt}/{a.scale_encoding}",
            lambda be: be.quantize_pair(x, a, b),
        )

    def gemm_nt(self, a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
        # Every backend accumulates in fp32 but the reference, which accumulates an fp64 output in
        # fp64 (``model.precision: fp64``, the CPU-independent golden runs): those go to it alone.
        fp64 = out_dtype == torch.float64
        return self._run(
            lambda be: (not fp64 or be.NAME == emulated.NAME) and be.supports_gemm(a, b, out_dtype),
            lambda: f"GEMM {tuple(a.block)} x {tuple(b.block)} {a.data.dtype}/{b.data.dtype} -> {out_dtype}",
            lambda be: be.gemm_nt(a, b, out_dtype),
        )


def _unpickle_kernels(recipe: Fp8Recipe, device: torch.device, names: tuple[str, ...]) -> Kernels:
    return Kernels(recipe, device, tuple(BACKENDS[n] for n in names))


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
