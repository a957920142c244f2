"""An RMSNorm that keeps its normalized output for backward only as its input and per-row rstd.

The Qwen2 / Llama RMSNorm is ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``, with ``x`` the
input in fp32. Autograd keeps, for its backward, ``x`` (for ``x^2`` and for ``x * rstd``), the per-row
``rstd`` and the normalized ``h = x * rstd`` (for the weight's gradient): two ``[T, H]`` fp32 tensors
and a ``[T, 1]`` one. ``h`` is kept twice over, in effect: the projections the norm feeds keep their own
copy of ``y = weight * h`` (in FP8, one byte per element, when they are ``Fp8Linear``).
:func:`recompute_rmsnorm` replaces the last three ops with one autograd function that keeps ``x`` and
``rstd`` (both already kept by ``x^2`` and ``rsqrt``: no new bytes) and makes ``h`` again in backward::

    forward   y = weight * (x * rstd).to(dtype)            keeps weight, x, rstd
    backward  h  = (x * rstd).to(dtype)                    the forward's op again: the same bits
              dw = sum_to(dy * h, weight).to(weight.dtype)
              dh = (dy * weight).to(dtype).to(x.dtype)     what the two Mul nodes and the cast ran
              dx = dh * rstd,  drstd = sum_to(dh * x, rstd)

These are the ops autograd runs for the three nodes it replaces, with the same dtype casts (the engine
sums a broadcast operand's gradient to its shape, then casts it to its dtype). The function takes the
place of the three nodes in the graph, so the input's gradients still arrive in the same order (the
residual's, this one's, then ``x^2``'s), and values and gradients are bit-identical to the plain norm
(``tests/test_nn_norm.py``): one ``[T, H]`` fp32 tensor fewer per norm, for one more ``x * rstd`` in
backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .swiglu import patch_forwards

__all__ = ["NORM_CLASSES", "recompute_rmsnorm"]

#: the transformers RMSNorm classes whose forward is the one above (a class not listed is left alone:
#: Gemma's, for one, scales by ``1 + weight``)
NORM_CLASSES = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "MixtralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen3RMSNorm",
        "Qwen3MoeRMSNorm",
    }
)


class _ScaleRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, weight: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        ctx.save_for_backward(weight, x, rstd)
        ctx.dtype = dtype
        return weight * (x * rstd).to(dtype)  # [H] * [..., H] -> [..., H]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight, x, rstd = ctx.saved_tensors
        need_w, need_x, need_r = ctx.needs_input_grad[:3]
        dw = dx = dr = None
        if need_w:
            dw = (dy * (x * rstd).to(ctx.dtype)).sum_to_size(weight.shape).to(weight.dtype)
        if need_x or need_r:
            dh = (dy * weight).to(ctx.dtype).to(x.dtype)  # [..., H]
            dx = dh * rstd if need_x else None
            dr = (dh * x).sum_to_size(rstd.shape).to(rstd.dtype) if need_r else None  # [..., 1]
        return dw, dx, dr, None


def _rmsnorm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    rstd = torch.rsqrt(variance + self.variance_epsilon)
    return _ScaleRows.apply(self.weight, x, rstd, input_dtype)


def _is_rmsnorm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ in NORM_CLASSES
        and isinstance(weight, nn.Parameter)
        and weight.ndim == 1
        and hasattr(module, "variance_epsilon")
    )


def recompute_rmsnorm(model: nn.Module) -> int:
    """Make every RMSNorm of ``model`` (a class of :data:`NORM_CLASSES`) keep only its input and rstd
    for backward (module doc); returns how many were changed. Parameters, state_dict keys, outputs and
    gradients are unchanged."""
    return patch_forwards(model, _is_rmsnorm, _rmsnorm_forward)
