"""Swap a model's decoder linears for ``Fp8Linear`` in place, and the other whole-model switches.

FP8 on / off for evaluation (``fp8_enabled``, ``disable_fp8``), how long a quantized weight lives
(``cache_fp8_weights``: one per step, or one per layer's forward until its backward), and the FP8 weight all-gather under FSDP2 (``enable_fp8_param_gather``
before ``fully_shard``, ``link_fsdp_params`` after; the tensor subclasses are ``infir2.nn.fsdp``).

The recipe runs every ``nn.Linear`` inside the decoder layers in FP8 (Qwen2 / Llama / Mistral: q, k,
v, o, gate, up, down; Phi-3: the fused qkv and gate_up too) and keeps the token embedding,
``lm_head``, norms, RoPE, the attention core and MoE routers in high precision (DeepSeek-V3 keeps
its gating in high precision). ``convert_to_fp8`` follows torchao's signature,
``module_filter_fn(module, fqn) -> bool``, and torchao's shape rule: a layer whose dimensions are not
multiples of 16 (what FP8 tensor-core GEMMs need) stays high precision. After converting it logs one
summary of what stayed high precision and why; a warning when any of it looks like it was meant to
be converted (a decoder linear of an odd shape, a GPT-2 style ``Conv1D``, an ``nn.Linear`` subclass).

Mixture-of-experts: the routed experts of transformers v5 MoE blocks (3-D ``gate_up_proj`` /
``down_proj``: Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 and the families that share the layout)
become ``infir2.nn.moe.Fp8Experts`` (same parameters, same keys); shared experts are plain linears
and convert as such; routers stay high precision. ``module_filter_fn`` is asked about each experts
module too. The summary counts the expert GEMMs and their share of the GEMM weights, and warns on
a module with 3-D expert weights that ``Fp8Experts`` does not run.

PEFT LoRA works in both orders: convert then ``get_peft_model`` (LoRA wraps the ``Fp8Linear``), or
LoRA first (the default filter converts each LoRA layer's ``base_layer``; the adapters ``lora_A`` /
``lora_B`` stay high precision, as in QLoRA).
"""

from __future__ import annotations

import logging
import math
import re
import weakref
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, cast

import torch
from torch import nn

from ..fp8.recipe import Fp8Recipe, get_recipe
from .fsdp import Fp8ShardedWeight
from .linear import Fp8Linear
from .module import Fp8Module
from .moe import Fp8Experts, is_routed_experts, unsupported_experts_reason
from .moe.fsdp import EXPERT_WEIGHTS, Fp8ShardedExperts, link_fsdp_experts

__all__ = [
    "DECODER_PROJECTIONS",
    "cache_fp8_weights",
    "convert_to_fp8",
    "default_module_filter",
    "disable_fp8",
    "enable_fp8_param_gather",
    "fp8_enabled",
    "fp8_expert_modules",
    "fp8_modules",
    "fp8_weight_names",
    "high_precision_tail_blocks",
    "link_fsdp_params",
    "unrecognised_experts",
    "why_high_precision",
]

log = logging.getLogger(__name__)

#: The seven projections of a Qwen2 / Llama decoder layer (the layers the FP8 export stores in FP8).
DECODER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: FP8 tensor-core GEMMs (cuBLAS ``_scaled_mm``, torchao's filter) need both dimensions multiples of 16.
SHAPE_MULTIPLE = 16

_IN_BLOCK = re.compile(r"(^|\.)\d+\.")  # a numbered child on the path: an element of ``layers`` / ``h``
_BLOCK_INDEX = re.compile(r"(^|\.)(\d+)\.")  # the same, with the block's index as group 2
_OUTPUT_HEADS = ("lm_head", "embed_out", "output")
_ROUTERS = ("gate", "router")  # Mixtral ``block_sparse_moe.gate``, Qwen2-MoE / DeepSeek ``mlp.gate``

ModuleFilter = Callable[[nn.Module, str], bool]


def _is_conv1d(module: nn.Module) -> bool:
    """A GPT-2 style ``transformers.pytorch_utils.Conv1D`` (a linear with its weight stored [in, out])."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def why_high_precision(module: nn.Module, fqn: str) -> str | None:
    """Why the default filter keeps ``module`` (at ``fqn``) in high precision; ``None``: it runs in FP8."""
    if _is_conv1d(module):
        return "GPT-2 style Conv1D (weight stored [in, out]), not nn.Linear"
    if type(module) is not nn.Linear:
        return f"{type(module).__name__}, not nn.Linear"
    names = fqn.split(".")
    if names[-1] in _OUTPUT_HEADS:
        return "output head"
    if any(n.startswith("lora_") for n in names):
        return "LoRA adapter"
    if names[-1] in _ROUTERS or names[-1].endswith(("_gate", "_router")):
        return "MoE router"
    if _IN_BLOCK.search(fqn) is None:
        return "outside the decoder layers"
    n, k = module.weight.shape
    if n % SHAPE_MULTIPLE or k % SHAPE_MULTIPLE:
        return f"shape [{n}, {k}] not a multiple of {SHAPE_MULTIPLE}"
    return None


def default_module_filter(module: nn.Module, fqn: str) -> bool:
    """True for every ``nn.Linear`` inside a decoder layer (a numbered child such as ``layers.3``) whose
    dimensions are multiples of 16, except output heads, MoE routers and LoRA adapters."""
    return why_high_precision(module, fqn) is None


def high_precision_tail_blocks(model: nn.Module, fraction: float) -> set[int]:
    """The indices of the last ``ceil(fraction * n)`` of the model's ``n`` decoder blocks (the numbered
    children that hold its linears): the blocks ``high_precision_tail`` keeps in high precision.

    torchtitan's low-precision recipes keep about the last 15% of the blocks (and ``lm_head``, which
    stays high precision here in any case) out of FP4: the last layers are the most sensitive to it.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(
            f"high_precision_tail is a fraction of the decoder blocks in [0, 1), got {fraction!r}"
        )
    indices = {
        int(match.group(2))
        for fqn, m in model.named_modules()
        if isinstance(m, nn.Linear) and (match := _BLOCK_INDEX.search(fqn)) is not None
    }
    if not indices or fraction == 0:
        return set()
    n = max(indices) + 1
    return set(range(n - math.ceil(fraction * n), n))


def _looks_convertible(module: nn.Module, fqn: str, reason: str) -> bool:
    """A layer left in high precision that a user would expect in FP8 (worth a warning)."""
    if _is_conv1d(module):
        return True
    in_block = _IN_BLOCK.search(fqn) is not None
    if isinstance(module, nn.Linear) and not isinstance(module, Fp8Linear) and type(module) is not nn.Linear:
        return in_block  # e.g. a quantized or custom Linear subclass
    return reason.startswith("shape")


def _summary(kept: dict[str, list[str]]) -> str:
    parts = []
    for reason, fqns in kept.items():
        names = ", ".join(fqns[:3]) + (f", ... ({len(fqns)} layers)" if len(fqns) > 3 else "")
        parts.append(f"{names} ({reason})")
    return "; ".join(parts)


def _no_layer_error(model: nn.Module, kept: dict[str, list[str]]) -> ValueError:
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    conv1d = [fqn for fqn, m in model.named_modules() if _is_conv1d(m)]
    if conv1d:
        return ValueError(
            f"no layer to convert to FP8: the model's projections are {len(conv1d)} GPT-2 style Conv1D "
            f"layers (e.g. {conv1d[0]!r}; transformers.pytorch_utils.Conv1D stores its weight [in, out]), "
            f"which Fp8Linear does not wrap; it converts nn.Linear only. Use an architecture with nn.Linear "
            f"projections (Qwen2, Llama, Mistral, Phi-3), or replace each Conv1D with an nn.Linear "
            f"(weight = conv.weight.t()) before converting"
        )
    why = _summary(kept)
    return ValueError(
        f"no layer to convert to FP8: the model has {n_linear} nn.Linear modules and none runs in FP8 "
        f"({why[:300]}{'...' if len(why) > 300 else ''}); use a model whose decoder projections are "
        f"multiples of {SHAPE_MULTIPLE} wide, or a recipe without FP8 (bf16)"
    )


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def convert_to_fp8(
    model: nn.Module,
    recipe: str | Fp8Recipe = "blockwise",
    module_filter_fn: ModuleFilter | None = None,
    backend: str | None = None,
    high_precision_tail: float = 0.0,
) -> nn.Module:
    """Replace every ``nn.Linear`` that ``module_filter_fn`` selects with an ``Fp8Linear`` (in place).

    The default filter is :func:`default_module_filter`. ``high_precision_tail`` (a fraction in [0, 1))
    keeps the last ``ceil(fraction * blocks)`` decoder blocks in high precision whatever the filter says
    (:func:`high_precision_tail_blocks`; 0.15 is torchtitan's choice for 4-bit training). Parameters are shared, not copied, so
    state_dict keys, tied weights and existing optimizers are unaffected. Returns ``model``. Logs
    what stayed high precision and why (a warning when a layer of it looks convertible). Raises
    ``ValueError`` when the model was already converted or when no layer qualifies; recipe ``bf16``
    converts nothing.
    """
    recipe = get_recipe(recipe)
    existing = [fqn for fqn, m in model.named_modules() if isinstance(m, Fp8Linear | Fp8Experts)]
    if existing:
        raise ValueError(
            f"model is already converted to FP8 ({len(existing)} FP8 modules, e.g. "
            f"{existing[0]!r}); convert_to_fp8 runs once per model"
        )
    if not recipe.enabled:
        log.info("recipe %r runs without FP8: no layer converted", recipe.name)
        return model
    chosen, kept, notable = [], defaultdict(list), False
    tail = high_precision_tail_blocks(model, high_precision_tail)
    for fqn, m in model.named_modules():
        if not (isinstance(m, nn.Linear) or _is_conv1d(m)):
            continue
        if tail and (match := _BLOCK_INDEX.search(fqn)) is not None and int(match.group(2)) in tail:
            kept[
                f"in the last {len(tail)} decoder block(s): high_precision_tail={high_precision_tail}"
            ].append(fqn)
            continue
        if type(m) is nn.Linear and (module_filter_fn or default_module_filter)(m, fqn):
            chosen.append(fqn)
            continue
        if module_filter_fn is not None and type(m) is nn.Linear:
            reason = "excluded by module_filter_fn"
        else:
            reason = why_high_precision(m, fqn) or "excluded by module_filter_fn"
        kept[reason].append(fqn)
        notable = notable or _looks_convertible(m, fqn, reason)
    experts = _select_experts(model, module_filter_fn, kept, tail, high_precision_tail)
    notable = notable or any(r.startswith(_UNRECOGNISED) for r in kept)
    if not chosen and not experts and tail:
        raise ValueError(
            f"high_precision_tail={high_precision_tail} keeps all {len(tail)} decoder block(s) of this model "
            "in high precision (the last ceil(fraction x blocks)): nothing is left to run in low precision; "
            "lower high_precision_tail (or drop a recipe's +tail), or use a model with more decoder blocks"
        )
    if not chosen and not experts:
        raise _no_layer_error(model, kept)
    if experts and not recipe.runs_experts:
        raise ValueError(
            f"recipe {recipe.name!r} (NVFP4) runs dense linears only: the routed experts ({experts[0]!r}, "
            f"{len(experts)} module(s)) run FP8 recipes; use an FP8 recipe (e.g. blockwise) for this model"
        )
    _warn_low_precision(model, chosen, experts)
    _swap_in(model, chosen, lambda m: Fp8Linear.from_linear(cast(nn.Linear, m), recipe, backend))
    _swap_in(model, experts, lambda m: Fp8Experts(m, recipe, backend))
    message = f"FP8 recipe {recipe.name!r}: converted {len(chosen)} linear layers"
    if experts:
        message += _experts_summary(model, chosen, experts)
    if kept:
        message += f"; high precision: {_summary(kept)}"
    log.log(logging.WARNING if notable else logging.INFO, message)
    return model


def _swap_in(model: nn.Module, fqns: list[str], make: Callable[[nn.Module], Fp8Module]) -> None:
    """Replace each module ``fqns`` names with ``make(module)``, named and bound to the model's device."""
    device = _device_of(model)
    for fqn in fqns:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        new = make(getattr(parent, child))
        new.fp8_name = fqn
        new.bind_kernels(device)  # an unusable backend override fails here, before any training
        setattr(parent, child, new)


def _warn_low_precision(model: nn.Module, chosen: list[str], experts: list[str]) -> None:
    weights = [model.get_submodule(fqn).weight for fqn in chosen]
    weights += [model.get_submodule(fqn).gate_up_proj for fqn in experts]
    low = sorted({str(w.dtype) for w in weights if w.dtype not in (torch.float32, torch.float64)})
    if low:
        log.warning(
            "FP8 layers will wrap %s parameters: the recipe keeps fp32 master weights (load the model "
            "with dtype=torch.float32, or call model.float() first)",
            "/".join(low),
        )


#: the reason a module with 3-D expert weights that ``Fp8Experts`` cannot run stays high precision
_UNRECOGNISED = "MoE experts not recognised"
_SHARED_OR_LISTED_EXPERT = re.compile(r"(^|\.)(shared_experts?|experts\.\d+)\.")


def why_experts_high_precision(module: nn.Module, fqn: str) -> str | None:
    """Why the default filter keeps a routed-experts module in high precision; ``None``: it runs in FP8."""
    if _IN_BLOCK.search(fqn) is None:
        return "outside the decoder layers"
    _, two_i, h = cast(torch.Tensor, module.gate_up_proj).shape
    if h % SHAPE_MULTIPLE or (two_i // 2) % SHAPE_MULTIPLE:
        return f"expert shape [{two_i // 2}, {h}] not a multiple of {SHAPE_MULTIPLE}"
    return None


def _owns_expert_weights(module: nn.Module) -> bool:
    return any(p.dim() == 3 and p.is_floating_point() for p in module.parameters(recurse=False))


def _select_experts(
    model: nn.Module,
    module_filter_fn: ModuleFilter | None,
    kept: dict[str, list[str]],
    tail: Collection[int] = (),
    fraction: float = 0.0,
) -> list[str]:
    """The routed-experts modules to convert; the others (and the routers) recorded in ``kept``."""
    chosen = []
    for fqn, m in model.named_modules():
        names = fqn.split(".")
        if (
            names[-1] in _ROUTERS
            and not isinstance(m, nn.Linear)
            and isinstance(getattr(m, "weight", None), nn.Parameter)
        ):
            kept["MoE router"].append(fqn)
        if not _owns_expert_weights(m):
            continue
        if tail and (match := _BLOCK_INDEX.search(fqn)) is not None and int(match.group(2)) in tail:
            kept[f"in the last {len(tail)} decoder block(s): high_precision_tail={fraction}"].append(fqn)
        elif not is_routed_experts(m):
            kept[f"{_UNRECOGNISED}: {type(m).__name__}, {unsupported_experts_reason(m)}"].append(fqn)
        elif module_filter_fn is not None and not module_filter_fn(m, fqn):
            kept["excluded by module_filter_fn"].append(fqn)
        elif module_filter_fn is None and (reason := why_experts_high_precision(m, fqn)) is not None:
            kept[reason].append(fqn)
        else:
            chosen.append(fqn)
    _routers_without_experts(model, kept)
    return chosen


def unrecognised_experts(model: nn.Module) -> list[tuple[str, str]]:
    """(fqn, why) of each MoE module of ``model`` whose experts ``convert_to_fp8`` cannot run in FP8 (they
    stay high precision, with a warning): 3-D expert weights of another layout, or a router without an
    experts module beside it. Reads only the module tree (a model built on the meta device will do)."""
    kept: dict[str, list[str]] = defaultdict(list)
    _select_experts(model, None, kept)
    return [
        (fqn, reason.removeprefix(f"{_UNRECOGNISED}: "))
        for reason, fqns in kept.items()
        if reason.startswith(_UNRECOGNISED)
        for fqn in fqns
    ]


def _routers_without_experts(model: nn.Module, kept: dict[str, list[str]]) -> None:
    """An MoE block whose router has no experts this module knows beside it (``experts`` neither a
    module with 3-D expert weights nor a ModuleList of linears) is recorded as not recognised."""
    for fqn in kept.get("MoE router", []):
        block_name = fqn.rpartition(".")[0]
        block = model.get_submodule(block_name)
        experts = getattr(block, "experts", None)
        if isinstance(experts, nn.ModuleList) or (
            isinstance(experts, nn.Module) and _owns_expert_weights(experts)
        ):
            continue
        reason = f"{_UNRECOGNISED}: {type(block).__name__} has a router but no experts module infir2 runs"
        if block_name not in kept[reason]:
            kept[reason].append(block_name)


def _experts_summary(model: nn.Module, chosen: list[str], experts: list[str]) -> str:
    """`` and N routed-expert groups ...``: the expert GEMMs and their share of the GEMM parameters."""
    groups = [g for g in map(model.get_submodule, experts) if isinstance(g, Fp8Experts)]
    routed = sum(2 * g.num_experts for g in groups)  # per expert: gate_up (fused) and down
    shared = [fqn for fqn in chosen if _SHARED_OR_LISTED_EXPERT.search(fqn)]
    expert_params = sum(g.gate_up_proj.numel() + g.down_proj.numel() for g in groups)
    expert_params += sum(cast(torch.Tensor, model.get_submodule(fqn).weight).numel() for fqn in shared)
    total = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    total += sum(p.numel() for m in model.modules() for p in m.parameters(recurse=False) if p.dim() == 3)
    return (
        f" and {len(groups)} routed-expert groups ({routed} expert GEMMs, 2 per expert"
        + (f", plus {len(shared)} linears of shared or per-module experts" if shared else "")
        + f"; experts hold {100 * expert_params / max(total, 1):.1f}% of the GEMM weight parameters)"
    )


def fp8_weight_names(model: nn.Module) -> set[str]:
    """The parameter names of ``model`` whose GEMMs run in FP8 (``weight`` of each ``Fp8Linear``,
    ``gate_up_proj`` / ``down_proj`` of each ``Fp8Experts``); for a model not converted, those that
    ``convert_to_fp8`` with the default filter would convert. What an FP8 export stores in FP8."""
    names = {f"{fqn}.weight" for fqn, _ in fp8_modules(model)}
    names |= {f"{fqn}.{p}" for fqn, _ in fp8_expert_modules(model) for p in ("gate_up_proj", "down_proj")}
    if names:
        return names
    for fqn, m in model.named_modules():
        if type(m) is nn.Linear and default_module_filter(m, fqn):
            names.add(f"{fqn}.weight")
        elif is_routed_experts(m) and why_experts_high_precision(m, fqn) is None:
            names |= {f"{fqn}.gate_up_proj", f"{fqn}.down_proj"}
    return names


def fp8_expert_modules(model: nn.Module) -> Iterator[tuple[str, Fp8Experts]]:
    for fqn, m in model.named_modules():
        if isinstance(m, Fp8Experts):
            yield fqn, m


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
    modules: list[Fp8Linear | Fp8Experts] = [m for _, m in fp8_modules(model)]
    modules += [m for _, m in fp8_expert_modules(model)]
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
def cache_fp8_weights(model: nn.Module, scope: str = "step") -> Iterator[nn.Module]:
    """Wrap the micro-batches of one optimizer step: how long each FP8 weight copy lives inside the block.

    ``step``: each weight is quantized once for the whole block and every layer's copy is kept until it
    exits (a weight modified in place inside the block, its version counter moved, is quantized again).
    ``layer`` (``fp8.weight_cache``'s default): each forward quantizes it and only autograd keeps it,
    until that layer's backward; the same bytes, so the same step (``infir2.nn.module``: the scopes).
    """
    modules = [m for m in model.modules() if isinstance(m, Fp8Module)]
    for m in modules:
        m.set_weight_scope(scope)
    try:
        yield model
    finally:
        for m in modules:
            m.set_weight_scope(None)


def enable_fp8_param_gather(module: nn.Module) -> list[str]:
    """Before ``fully_shard``: make the weights of ``module``'s FP8 linears and experts all-gather as FP8 codes.

    Only layers whose recipe :attr:`~infir2.fp8.recipe.Fp8Recipe.gathers_fp8_weight` are changed (their
    weight becomes an ``infir2.nn.fsdp.Fp8ShardedWeight``, an expert weight an
    ``infir2.nn.moe.fsdp.Fp8ShardedExperts``); returns their names.
    """
    changed = []
    for name, m in fp8_modules(module):
        if m.fp8_enabled and m.recipe.gathers_fp8_weight:
            if not isinstance(m.weight.data, Fp8ShardedWeight):
                m.weight = nn.Parameter(Fp8ShardedWeight(m.weight.data), requires_grad=m.weight.requires_grad)
            changed.append(name)
    for name, g in fp8_expert_modules(module):  # whole experts per rank: infir2.nn.moe.fsdp
        if g.fp8_enabled and g.recipe.gathers_fp8_weight:
            for p in EXPERT_WEIGHTS:
                w = getattr(g, p)
                if not isinstance(w.data, Fp8ShardedExperts):
                    setattr(g, p, nn.Parameter(Fp8ShardedExperts(w.data), requires_grad=w.requires_grad))
                changed.append(f"{name}.{p}")
    return changed


def link_fsdp_params(fsdp_module: nn.Module) -> None:
    """After ``fully_shard(fsdp_module)``: let its FP8 all-gather weights find their FSDP2 parameter.

    Needed to switch a weight between FP8 and high-precision all-gather (``disable_fp8``), and for
    the one block-amax all-reduce per FSDP unit (``infir2.nn.fsdp``: each weight knows the unit's FP8
    weights in FSDP2's all-gather order).
    """
    for group in _param_groups(fsdp_module._get_fsdp_state()):  # type: ignore[operator]
        link_fsdp_experts(group.fsdp_params)  # the experts' FP8 weights (no amax all-reduce)
        fp8_params = [p for p in group.fsdp_params if type(p._sharded_local_tensor) is Fp8ShardedWeight]
        peers = tuple(weakref.ref(p) for p in fp8_params)
        for index, fsdp_param in enumerate(fp8_params):
            setattr(fsdp_param._module_info.module, "_fp8_fsdp_param", weakref.ref(fsdp_param))  # noqa: B010
            setattr(fsdp_param._module_info.module, "_fp8_amax_peers", (peers, index))  # noqa: B010


def _param_groups(state: object) -> list[Any]:
    """The parameter groups of an FSDP2 state: ``_fsdp_param_groups`` (torch >= 2.12, a list) or the
    single ``_fsdp_param_group`` of torch 2.11 (None for a module without parameters of its own)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]
