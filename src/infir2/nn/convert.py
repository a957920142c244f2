"""Swap a model's projections for ``Fp8Linear`` in place, and the other whole-model switches.

FP8 on / off for evaluation (``fp8_enabled``, ``disable_fp8``), one quantized weight per step
(``cache_fp8_weights``), and the FP8 weight all-gather under FSDP2 (``enable_fp8_param_gather``
before ``fully_shard``, ``link_fsdp_params`` after; the tensor subclasses are ``infir2.nn.fsdp``).

The recipe puts the seven projections of every decoder layer in FP8 (q, k, v, o, gate, up, down)
and keeps the token embedding, ``lm_head``, norms, RoPE and the attention core in high precision.
``convert_to_fp8`` follows torchao's signature, ``module_filter_fn(module, fqn) -> bool``.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

from ..fp8.recipe import Fp8Recipe, get_recipe
from .fsdp import Fp8ShardedWeight
from .linear import Fp8Linear

__all__ = ["DECODER_PROJECTIONS", "cache_fp8_weights", "convert_to_fp8", "default_module_filter",
           "disable_fp8", "enable_fp8_param_gather", "fp8_enabled", "fp8_modules", "link_fsdp_params"]  # fmt: skip

log = logging.getLogger(__name__)

#: The seven projections of a Qwen2 / Llama decoder layer that run in FP8.
DECODER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_DECODER_FQN = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(" + "|".join(DECODER_PROJECTIONS) + r")$")

ModuleFilter = Callable[[nn.Module, str], bool]


def default_module_filter(module: nn.Module, fqn: str) -> bool:
    """True for the q/k/v/o/gate/up/down projections of decoder layers (``...layers.<i>.self_attn.q_proj``)."""
    return isinstance(module, nn.Linear) and _DECODER_FQN.search(fqn) is not None


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def convert_to_fp8(
    model: nn.Module,
    recipe: str | Fp8Recipe = "blockwise",
    module_filter_fn: ModuleFilter | None = None,
    backend: str | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` that ``module_filter_fn`` selects with an ``Fp8Linear`` (in place).

    Parameters are shared, not copied, so state_dict keys, tied weights and existing optimizers are
    unaffected. Returns ``model``. Raises ``ValueError`` when the model was already converted or
    when no layer qualifies; recipe ``bf16`` converts nothing.
    """
    recipe = get_recipe(recipe)
    existing = [fqn for fqn, m in model.named_modules() if isinstance(m, Fp8Linear)]
    if existing:
        raise ValueError(f"model is already converted to FP8 ({len(existing)} Fp8Linear modules, e.g. "
                         f"{existing[0]!r}); convert_to_fp8 runs once per model")  # fmt: skip
    if not recipe.enabled:
        log.info("recipe %r runs without FP8: no layer converted", recipe.name)
        return model
    filter_fn = module_filter_fn or default_module_filter
    chosen = [fqn for fqn, m in model.named_modules() if type(m) is nn.Linear and filter_fn(m, fqn)]
    if not chosen:
        n_linear = sum(type(m) is nn.Linear for m in model.modules())
        raise ValueError(f"no layer to convert to FP8: the model has {n_linear} nn.Linear modules and the "
                         f"module filter selected none")  # fmt: skip
    low = sorted(
        {
            str(m.weight.dtype)
            for fqn in chosen
            if (m := model.get_submodule(fqn)).weight.dtype not in (torch.float32, torch.float64)
        }
    )
    if low:
        log.warning("FP8 layers will wrap %s parameters: the recipe keeps fp32 master weights (load the model "
                    "with dtype=torch.float32, or call model.float() first)", "/".join(low))  # fmt: skip
    device = _device_of(model)
    for fqn in chosen:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = Fp8Linear.from_linear(getattr(parent, child), recipe, backend)
        layer.bind_kernels(device)  # an unusable backend override fails here, before any training
        setattr(parent, child, layer)
    log.info("FP8 recipe %r: converted %d linear layers", recipe.name, len(chosen))
    return model


def fp8_modules(model: nn.Module) -> Iterator[tuple[str, Fp8Linear]]:
    for fqn, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            yield fqn, m


@contextmanager
def fp8_enabled(model: nn.Module, on: bool) -> Iterator[nn.Module]:
    """Run ``model``'s FP8 layers in FP8 (``on=True``) or in high precision (``on=False``) inside the block.

    The one switch for "FP8 or not" around evaluation and generation; restores each layer's state after.
    ``on=True`` on a model with no ``Fp8Linear`` is an error (it would silently measure high precision).
    """
    modules = [m for _, m in fp8_modules(model)]
    if on and not modules:
        raise ValueError(
            "FP8 requested but the model has no Fp8Linear layers; call infir2.convert_to_fp8 first"
        )
    before = [(m, m.fp8_enabled) for m in modules]
    for m in modules:
        m.fp8_enabled = on and m.recipe.enabled
    try:
        yield model
    finally:
        for m, enabled in before:
            m.fp8_enabled = enabled


def disable_fp8(model: nn.Module) -> AbstractContextManager[nn.Module]:
    """Run ``model`` in high precision inside the block (e.g. for evaluation): ``fp8_enabled(model, False)``."""
    return fp8_enabled(model, False)


@contextmanager
def cache_fp8_weights(model: nn.Module) -> Iterator[nn.Module]:
    """Quantize each FP8 weight once for the whole block (the micro-batches of one optimizer step).

    A weight modified in place inside the block (its version counter moves) is quantized again.
    """
    modules = [m for _, m in fp8_modules(model)]
    for m in modules:
        m.cache_weight, m._weight_cache = True, None
    try:
        yield model
    finally:
        for m in modules:
            m.cache_weight, m._weight_cache = False, None


def enable_fp8_param_gather(module: nn.Module) -> list[str]:
    """Before ``fully_shard``: make the weights of ``module``'s FP8 linears all-gather as FP8 codes.

    Only layers whose recipe :attr:`~infir2.fp8.recipe.Fp8Recipe.gathers_fp8_weight` are changed (their
    weight becomes an ``infir2.nn.fsdp.Fp8ShardedWeight``); returns their names.
    """
    changed = []
    for name, m in fp8_modules(module):
        if m.fp8_enabled and m.recipe.gathers_fp8_weight:
            if not isinstance(m.weight.data, Fp8ShardedWeight):
                m.weight = nn.Parameter(Fp8ShardedWeight(m.weight.data), requires_grad=m.weight.requires_grad)
            changed.append(name)
    return changed


def link_fsdp_params(fsdp_module: nn.Module) -> None:
    """After ``fully_shard(fsdp_module)``: let its FP8 all-gather weights find their FSDP2 parameter.

    Needed only to switch a weight between FP8 and high-precision all-gather (``disable_fp8``).
    """
    states = fsdp_module._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]
    for group in states:
        for fsdp_param in group.fsdp_params:
            if isinstance(fsdp_param._sharded_local_tensor, Fp8ShardedWeight):
                setattr(fsdp_param._module_info.module, "_fp8_fsdp_param", weakref.ref(fsdp_param))  # noqa: B010
