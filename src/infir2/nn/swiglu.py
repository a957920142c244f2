"""A SwiGLU MLP that keeps only what backward cannot recompute.

The Qwen2 / Llama MLP is ``down(silu(gate(x)) * up(x))``. Autograd keeps, for its backward, the gate
output ``g``, ``silu(g)``, the up output ``u`` and the product ``h = silu(g) * u`` (the down
projection's input): four ``[T, I]`` tensors, with ``I`` about 5.8x the hidden size, most of a
decoder layer's activation memory. :func:`recompute_swiglu` replaces the product with one autograd
function that keeps ``g`` and ``u`` and recomputes ``silu(g)`` in backward::

    forward   h  = silu(g) * u                       keeps g, u
    backward  dg = silu_backward(dh * u, g)          the ops autograd itself runs, in the same order
              du = dh * silu(g)

so values and gradients are bit-identical to the plain MLP. ``silu(g)`` is never kept, and ``h`` is
kept only by the down projection: in FP8 (one byte per element) when it is an ``Fp8Linear``, which
is what makes FP8 save MLP memory at all. The same recompute serves a high-precision baseline.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["recompute_swiglu", "swiglu"]


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        return F.silu(g) * u  # [T, I] * [T, I] -> [T, I]

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        g, u = ctx.saved_tensors
        dg = torch.ops.aten.silu_backward(dh * u, g) if ctx.needs_input_grad[0] else None
        du = dh * F.silu(g) if ctx.needs_input_grad[1] else None
        return dg, du


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` keeping only ``g`` and ``u`` for backward (see the module doc)."""
    return _SwiGLU.apply(g, u)


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _is_swiglu_mlp(module: nn.Module) -> bool:
    names = ("gate_proj", "up_proj", "down_proj")
    act = getattr(module, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    return silu and all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def recompute_swiglu(model: nn.Module) -> int:
    """Make every SwiGLU MLP of ``model`` (``gate_proj`` / ``up_proj`` / ``down_proj`` with a SiLU
    ``act_fn``) recompute its activation in backward; returns how many were changed. Parameters,
    state_dict keys and outputs are unchanged."""
    count = 0
    for module in model.modules():
        if _is_swiglu_mlp(module) and getattr(module.forward, "__func__", None) is not _mlp_forward:
            module.forward = types.MethodType(_mlp_forward, module)
            count += 1
    return count
