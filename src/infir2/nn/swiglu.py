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

``fp8_saved=True`` (``model.mlp_saved_fp8``, off by default) keeps ``g`` and ``u`` themselves in FP8,
as COAT and DeepSeek-V3 keep the SwiGLU's inputs: E4M3 codes with one power-of-two fp32 scale per token
per 128 channels (the blockwise recipe's activation tiles), decoded in backward before the same ops.
The forward is unchanged (it reads the unquantized ``g`` and ``u``); the gradients read the decoded
ones, so they are not bit-identical: lossy, and a setting until measured equivalent (BENCHMARKS.md).
Two ``[T, I]`` tensors of the autocast dtype become one byte per element plus 4 bytes per 128.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..fp8.formats import BLOCK
from ..fp8.quantize import dequantize, quantize

__all__ = ["SAVED_TILE", "patch_forwards", "recompute_swiglu", "swiglu"]

#: the tiles of ``fp8_saved``'s codes (module doc): one scale per token per 128 channels
SAVED_TILE = (1, BLOCK)


def _grads(
    ctx: Any, dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    dg = torch.ops.aten.silu_backward(dh * u, g) if ctx.needs_input_grad[0] else None
    du = dh * F.silu(g) if ctx.needs_input_grad[1] else None
    return dg, du


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        return F.silu(g) * u  # [T, I] * [T, I] -> [T, I]

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        g, u = ctx.saved_tensors
        return _grads(ctx, dh, g, u)


class _Fp8SavedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # [T, I] -> E4M3 codes [T, I] and scales [T, I / 128], each
            codes = [quantize(t.detach().reshape(-1, t.shape[-1]), SAVED_TILE) for t in (g, u)]
        ctx.save_for_backward(*codes[0], *codes[1])
        ctx.shapes, ctx.dtypes = (g.shape, u.shape), (g.dtype, u.dtype)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        g_data, g_scale, u_data, u_scale = ctx.saved_tensors
        (g_shape, u_shape), (g_dtype, u_dtype) = ctx.shapes, ctx.dtypes
        g = dequantize(g_data, g_scale, SAVED_TILE, g_dtype).view(g_shape)
        u = dequantize(u_data, u_scale, SAVED_TILE, u_dtype).view(u_shape)
        return _grads(ctx, dh, g, u)


def swiglu(g: torch.Tensor, u: torch.Tensor, fp8_saved: bool = False) -> torch.Tensor:
    """``silu(g) * u`` keeping only ``g`` and ``u`` for backward, in FP8 with ``fp8_saved`` (module doc)."""
    return (_Fp8SavedSwiGLU if fp8_saved else _SwiGLU).apply(g, u)


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _mlp_forward_fp8_saved(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), fp8_saved=True))


def _is_swiglu_mlp(module: nn.Module) -> bool:
    names = ("gate_proj", "up_proj", "down_proj")
    act = getattr(module, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    return silu and all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def recompute_swiglu(model: nn.Module, fp8_saved: bool = False) -> int:
    """Make every SwiGLU MLP of ``model`` (``gate_proj`` / ``up_proj`` / ``down_proj`` with a SiLU
    ``act_fn``) recompute its activation in backward, keeping the gate and up outputs in FP8 with
    ``fp8_saved`` (module doc); returns how many were changed. Parameters, state_dict keys and outputs
    are unchanged."""
    return patch_forwards(model, _is_swiglu_mlp, _mlp_forward_fp8_saved if fp8_saved else _mlp_forward)


def patch_forwards(
    model: nn.Module, matches: Callable[[nn.Module], bool], forward: Callable[..., Any]
) -> int:
    """Bind ``forward`` as the forward of every module of ``model`` that ``matches`` and does not run it
    yet (an instance attribute: parameters and state_dict keys unchanged); returns how many."""
    count = 0
    for module in model.modules():
        if matches(module) and getattr(module.forward, "__func__", None) is not forward:
            module.forward = types.MethodType(forward, module)
            count += 1
    return count
