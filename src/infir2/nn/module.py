"""``Fp8Module``: what every FP8 module of ``nn/`` holds, once -- ``Fp8Linear`` and ``Fp8Experts`` subclass it.

An FP8 module runs some GEMMs in FP8 under one recipe and owns, besides its parameters:

    recipe, backend_name   the scaling (``infir2.fp8.recipe``) and a forced backend (None: the device's chain)
    fp8_enabled            False: the module runs its high-precision forward (``infir2.nn.fp8_enabled``)
    kernels                the recipe's kernels bound on one device (``bind_kernels``; bound again on another)
    cache_weight           inside ``cache_fp8_weights(model, "step")``: each FP8 weight is quantized once
                           per step and kept, every layer's, until the block exits
    k_major_dgrad          inside ``cache_fp8_weights(model, "layer")``: no cache; on CUDA backward copies
                           the saved FP8 weight K-major for dgrad (``Fp8Linear``), as the step cache does
                           once per step
    _weight_cache          {weight name: (key, value)}, the key reading the weight's version, storage,
                           device, dtype, the recipe and the backend (``weight_key``): an in-place update
                           or a new backend misses

How long a layer's FP8 weight copy lives (``WEIGHT_SCOPES``, ``fp8.weight_cache``). ``layer`` (the
trainer's default): it is quantized in forward and held only by autograd, as a saved tensor of that
layer's GEMMs, so it is freed after the layer's backward; under activation checkpointing forward keeps
none and the recompute quantizes it again, so one layer's copy is alive at a time (as BF16's autocast
copies). ``step``: the cache keeps every layer's copy (and on CUDA its K-major transpose) from the
first micro-batch to the end of the step, quantizing once per step whatever the micro-batches and the
recompute. Both quantize the same weight with the same kernel: the bytes, and so the step, are
identical. Outside any block (evaluation, a plain module) nothing is cached and dgrad reads the
transpose as a view. A weight all-gathered as FP8 codes by FSDP2 is the GEMMs' copy in every scope.
    stats                  {weight name: recorder} on a telemetry stats step (``infir2.nn.telemetry``), else None
    op_key                 its key in the one registry of FP8 modules (``module_by_key``), how a
                           ``torch.library`` custom op (plain values only) names it under ``torch.compile``

The registry holds each module weakly: a freed module's key is an error. A copy (``deepcopy``, pickle)
is another module: it registers under a new key and starts with an empty weight cache.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from ..fp8.recipe import Cast, Fp8Recipe, get_recipe
from ..kernels import BACKENDS, ORDER, Kernels, Operand, bind, emulated

__all__ = ["WEIGHT_SCOPES", "Fp8Module", "Recorder", "module_by_key"]

log = logging.getLogger(__name__)
_WARNED_EMULATED: set[tuple[str, torch.device]] = set()  # (recipe, device) already warned about

M = TypeVar("M", bound="Fp8Module")

#: how long an FP8 weight copy lives inside ``cache_fp8_weights`` (module doc): ``fp8.weight_cache``
WEIGHT_SCOPES = ("layer", "step")

# Every FP8 module by key, held weakly (module doc).
_MODULES: weakref.WeakValueDictionary[int, Fp8Module] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def module_by_key(key: int, kind: type[M]) -> M:
    """The ``kind`` (``Fp8Linear``, ``Fp8Experts``) registered under ``key`` (its ``op_key``)."""
    module = _MODULES.get(key)
    if not isinstance(module, kind):
        raise RuntimeError(
            f"no {kind.__name__} with key {key}: the module was freed (or the key is another kind's)"
        )
    return module


class Recorder(Protocol):
    """What an FP8 module reports one weight's operands to on a stats step (``infir2.nn.telemetry.LayerStats``)."""

    sqnr_taken: bool  # the first forward of the step measures SQNR, the others only count

    @property
    def forward(self) -> Callable[..., Any]:
        """A dense layer's forward report: ``(x, weight, bias, x_ops, w_fprop, y)`` -> the probe backward calls."""

    def add(self, operand: str, x: torch.Tensor, op: Operand, cast: Cast) -> None: ...

    def add_sqnr(self, result: str, reference: torch.Tensor, got: torch.Tensor) -> None: ...


def _warn_if_emulated_on_gpu(module: Fp8Module, kernels: Kernels) -> None:
    """A warning, once per recipe and device, when a CUDA module's GEMMs can only run on the emulated
    backend (an A100; mxfp8 on Blackwell): the module named, and why each GPU backend is out."""
    key = (module.recipe.name, kernels.device)
    if kernels.device.type != "cuda" or kernels.chain[0].NAME != emulated.NAME or key in _WARNED_EMULATED:
        return
    _WARNED_EMULATED.add(key)
    reasons = [
        f"{name}: {why}"
        for name in ORDER["cuda"]
        if name != emulated.NAME and (why := BACKENDS[name].why_unavailable(module.recipe, kernels.device))
    ]
    log.warning(
        "FP8 recipe %r on %s: the GEMMs of %s (and of every other layer of this recipe here) run on the "
        "emulated backend, dequantize + fp32 matmul, slower than BF16 (%s)",
        module.recipe.name,
        kernels.device,
        module.fp8_name or module.describe(),
        "; ".join(reasons),
    )


class Fp8Module(nn.Module):
    """The state and the binding every FP8 module shares (module doc); a subclass calls ``_init_fp8``."""

    #: the names of the weights whose GEMMs run in FP8 (the keys of the weight cache and of ``stats``)
    FP8_WEIGHTS: tuple[str, ...] = ()

    recipe: Fp8Recipe
    backend_name: str | None
    fp8_enabled: bool
    kernels: Kernels | None
    cache_weight: bool
    k_major_dgrad: bool
    stats: dict[str, Recorder] | None
    fp8_name: str
    op_key: int
    _weight_cache: dict[str, tuple[tuple[Any, ...], Any]]

    def _init_fp8(self, recipe: str | Fp8Recipe, backend: str | None) -> None:
        self.recipe = get_recipe(recipe)
        self.backend_name = backend
        self.fp8_enabled = self.recipe.enabled
        self.kernels = None
        self.cache_weight = False
        self.k_major_dgrad = False
        self._weight_cache = {}
        self.stats = None  # set by infir2.nn.telemetry on stats steps only
        self.fp8_name = ""  # its name in the model (convert_to_fp8 sets it), for warnings
        self._register()

    def _register(self) -> None:
        self.op_key = next(_KEYS)
        _MODULES[self.op_key] = self

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._weight_cache = {}
        self._register()  # a copy (deepcopy, pickle) is another module: its own key

    def describe(self) -> str:
        """The module's class and its ``extra_repr`` (for messages where it has no name in a model)."""
        return f"{type(self).__name__}({self.extra_repr()})"

    def bind_kernels(self, device: torch.device | str) -> Kernels:
        """Bind to the kernels of the recipe on ``device`` (an error for an unusable backend)."""
        self.kernels = bind(self.recipe, device, self.backend_name)
        if self.backend_name != emulated.NAME:
            _warn_if_emulated_on_gpu(self, self.kernels)
        return self.kernels

    def _kernels_on(self, device: torch.device) -> Kernels:
        if self.kernels is None or self.kernels.device != device:
            return self.bind_kernels(device)
        return self.kernels

    def weight_key(self, w: torch.Tensor, kernels: Kernels) -> tuple[Any, ...]:
        """What a cached FP8 copy of ``w`` is valid for (module doc)."""
        return (w._version, w.data_ptr(), w.device, w.dtype, self.recipe, kernels.name)

    def cached(self, name: str, key: tuple[Any, ...]) -> Any | None:
        """The cached value of weight ``name`` under ``key``, or None (off, empty or stale)."""
        entry = self._weight_cache.get(name)
        return entry[1] if self.cache_weight and entry is not None and entry[0] == key else None

    def store(self, name: str, key: tuple[Any, ...], value: Any) -> None:
        """Keep ``value`` for weight ``name`` while the cache is on (outside it, keep nothing)."""
        if self.cache_weight:
            self._weight_cache[name] = (key, value)
        else:
            self._weight_cache.pop(name, None)

    def set_weight_cache(self, on: bool) -> None:
        """Turn the weight cache on or off (``cache_fp8_weights``); either way it starts empty."""
        self.set_weight_scope("step" if on else None)

    def set_weight_scope(self, scope: str | None) -> None:
        """How long the FP8 weight copies live: a scope of ``WEIGHT_SCOPES`` (module doc), or None
        (outside ``cache_fp8_weights``); the cache starts empty."""
        if scope is not None and scope not in WEIGHT_SCOPES:
            raise ValueError(f"weight cache scope: expected one of {', '.join(WEIGHT_SCOPES)}, got {scope!r}")
        self.cache_weight, self.k_major_dgrad, self._weight_cache = scope == "step", scope == "layer", {}

    def recorder(self, name: str) -> Recorder | None:
        """The telemetry recorder of weight ``name`` on a stats step, else None."""
        return self.stats.get(name) if self.stats is not None else None
