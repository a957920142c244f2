"""The tensor names of a Hugging Face folder for a transformers v5 model, and which of them are FP8.

transformers v5 keeps some weights fused in memory that its checkpoints store apart: the routed
experts of Qwen3-MoE / Qwen2-MoE / DeepSeek-V3 are ``mlp.experts.gate_up_proj [E, 2I, H]`` and
``mlp.experts.down_proj [E, H, I]`` in the model but ``mlp.experts.<e>.gate_proj.weight`` /
``up_proj`` / ``down_proj`` in the published checkpoints (``block_sparse_moe.experts.<e>.w1`` /
``w3`` / ``w2`` for Mixtral), which is the layout vLLM, SGLang and the published FP8 checkpoints use.
``save_pretrained`` writes that layout by reverting the model type's conversion mapping
(``transformers.core_model_loading.revert_weight_conversion``); :func:`checkpoint_tensors` does the
same for an export, so each expert's weight becomes its own 2-D tensor with its own 128x128-block
``weight_scale_inv``. :func:`fold_checkpoint_tensors` is the way back for infir2's own FP8 loader.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..nn.convert import fp8_weight_names

__all__ = ["checkpoint_tensors", "fold_checkpoint_tensors", "fp8_weight_names", "modules_to_not_convert"]

_ROUTERS = ("gate", "router")


def _revert(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    if not state or not isinstance(model, PreTrainedModel):
        return state
    return dict(revert_weight_conversion(model, state))


def checkpoint_tensors(
    model: nn.Module, state: Mapping[str, torch.Tensor], fp8: set[str] | None = None
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """``state`` (named as ``model``'s parameters) in the checkpoint layout of ``model``'s type, and the
    names of the tensors among them that an FP8 export stores in FP8 (``fp8``, by model parameter
    name; default ``fp8_weight_names(model)``)."""
    fp8 = fp8_weight_names(model) if fp8 is None else fp8
    fp8_part = _revert(model, {k: v for k, v in state.items() if k in fp8})
    rest = _revert(model, {k: v for k, v in state.items() if k not in fp8})
    return {**rest, **fp8_part}, set(fp8_part)


def modules_to_not_convert(model: nn.Module) -> list[str]:
    """The linears and MoE routers an FP8 export keeps in high precision (``lm_head``, routers, layers
    the recipe skipped): ``quantization_config.modules_to_not_convert``, so loaders do not expect FP8."""
    fp8 = fp8_weight_names(model)
    names = []
    for fqn, m in model.named_modules():
        weight = getattr(m, "weight", None)
        is_router = fqn.split(".")[-1] in _ROUTERS and isinstance(weight, nn.Parameter) and weight.dim() == 2
        if (isinstance(m, nn.Linear) or is_router) and f"{fqn}.weight" not in fp8:
            names.append(fqn)
    return names


def fold_checkpoint_tensors(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` in the checkpoint layout back to ``model``'s parameter names (fused experts).

    Each model tensor missing from ``state`` is rebuilt from the checkpoint tensors it is saved as:
    reverting a tensor of its element indices shows where each element went.
    """
    own = dict(model.state_dict())
    out = dict(state)
    for name, param in own.items():
        if name in out:
            continue
        index = torch.arange(param.numel(), dtype=torch.float64).view(param.shape)  # exact below 2**53
        parts = _revert(model, {name: index})
        if set(parts) == {name} or not set(parts) <= set(out):
            continue  # not a converted tensor, or its parts are missing: load_state_dict reports it
        fused = torch.empty(param.numel(), dtype=out[next(iter(parts))].dtype)
        for part, where in parts.items():
            fused[where.reshape(-1).long()] = out.pop(part).reshape(-1)
        out[name] = fused.view(param.shape)
    return out
