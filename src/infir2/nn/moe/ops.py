"""``Fp8Experts`` under ``torch.compile``: each grouped FP8 linear as two ``torch.library`` custom ops.

The grouped GEMM loops over experts with row counts known only at run time (a host read of the
routing), and its kernels are a ``ctypes`` call and Python caches; traced, each would break the
graph. So under ``torch.compile`` each projection of the experts calls

    infir2::fp8_grouped_linear(x [S, K], weight [E, N, K], counts [E], experts, name)
        -> y [S, N], x_wgrad data [S, K] fp8, its scale_inv [E + S // bm, ceil(K / bk)]
    infir2::fp8_grouped_linear_backward(dy [S, N], <the saved FP8 copy>, weight, counts, experts, name, needs)
        -> dX [S, K], dW [E, N, K]

which run the eager ``_Fp8GroupedLinearFunction``'s own ``forward`` / ``backward`` inside: compiled
numerics are the eager numerics bit for bit. The FP8 wgrad copy of every expert's rows comes out of
the forward op so that the compiled graph saves it (the FP8 bytes, as eager does); its per-expert
scales are stacked into a tensor of static shape -- each expert's ``ceil(S_e / bm)`` scale rows,
then padding up to ``E + S // bm``, the most any routing can need. The weights' FP8 copies are not
outputs: backward takes them from the weight cache (``cache_fp8_weights``) or quantizes again, which
gives the same bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from ...fp8.formats import get_format
from ...fp8.recipe import Cast
from ...kernels.grouped import group_bounds
from ..module import module_by_key
from .experts import Fp8Experts
from .grouped_linear import _Fp8GroupedLinearFunction

__all__ = ["fp8_grouped_linear", "fp8_grouped_linear_backward"]


class _Context:
    """Stands in for the autograd ctx of ``_Fp8GroupedLinearFunction`` inside a custom op."""

    def __init__(self, needs_input_grad: tuple[bool, ...] = ()) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple[torch.Tensor, ...] = ()
        self.w_kept: Any = None
        self.n_x = 0
        self.bounds: list[tuple[int, int]] = []
        self.recipe: Any = None
        self.kernels: Any = None
        self.x_dtype: torch.dtype | None = None
        self.probe: Any = None  # telemetry does not record compiled experts

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors


def _scale_dtype(cast: Cast) -> torch.dtype:
    return torch.float8_e8m0fnu if cast.scale_encoding == "e8m0" else torch.float32


def _scale_rows(count: Any, bm: int) -> Any:
    """Scale rows of one expert's ``count`` rows for a block of ``bm`` rows (-1: the whole dimension)."""
    return (1 if count else 0) if bm == -1 else -(-count // bm)


def _scale_shape(rows: Any, cols: int, experts: int, cast: Cast) -> tuple[Any, int]:
    bm, bk = cast.block
    bound = experts + (0 if bm == -1 else rows // bm)  # each expert adds at most one partial block
    return bound, (1 if bk == -1 else -(-cols // bk))


@torch.library.custom_op("infir2::fp8_grouped_linear", mutates_args=())
def fp8_grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, experts: int, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    module = module_by_key(experts, Fp8Experts)
    kernels = module._kernels_on(x.device)
    ctx = _Context()
    with torch.no_grad():
        rows = counts.tolist()  # MoE routing: the experts' row split, read on the host (compiled path)
        y = _Fp8GroupedLinearFunction.forward(
            ctx, x, weight, rows, module.recipe, kernels, module.quantized_weights(name, kernels)
        )
    saved = ctx.saved_tensors[1 : 1 + ctx.n_x]  # per expert with rows: data, scale_inv
    cast = module.recipe.x_wgrad
    data = torch.cat(saved[0::2]) if saved else x.new_empty((0, x.shape[1]), dtype=get_format(cast.fmt).dtype)
    scales = x.new_zeros(
        _scale_shape(x.shape[0], x.shape[1], weight.shape[0], cast), dtype=_scale_dtype(cast)
    )
    if saved:
        stacked = torch.cat(saved[1::2])
        scales[: stacked.shape[0]] = stacked
    return y, data, scales


@fp8_grouped_linear.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, experts: int, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cast = module_by_key(experts, Fp8Experts).recipe.x_wgrad
    y = x.new_empty((x.shape[0], weight.shape[1]))
    data = x.new_empty(tuple(x.shape), dtype=get_format(cast.fmt).dtype)
    scales = x.new_empty(
        _scale_shape(x.shape[0], x.shape[1], weight.shape[0], cast), dtype=_scale_dtype(cast)
    )
    return y, data, scales


@torch.library.custom_op("infir2::fp8_grouped_linear_backward", mutates_args=())
def fp8_grouped_linear_backward(
    dy: torch.Tensor,
    x_data: torch.Tensor,
    x_scales: torch.Tensor,
    weight: torch.Tensor,
    counts: torch.Tensor,
    experts: int,
    name: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    module = module_by_key(experts, Fp8Experts)
    recipe, kernels = module.recipe, module._kernels_on(dy.device)
    ctx = _Context(tuple(needs))
    ctx.bounds, ctx.recipe, ctx.kernels, ctx.x_dtype = (
        group_bounds(counts.tolist()),  # MoE routing: the row split again, in the backward op
        recipe,
        kernels,
        dy.dtype,
    )
    x_saved, row = [], 0
    for start, end in ctx.bounds:
        if end > start:
            n = _scale_rows(end - start, recipe.x_wgrad.block[0])
            x_saved += [x_data[start:end], x_scales[row : row + n]]
            row += n
    ctx.n_x = len(x_saved)
    ctx.saved_tensors = (weight, *x_saved)
    if recipe.reuses_weight:  # the forward's weights: from the cache, or quantized again (the same bytes)
        ctx.w_kept = module.quantized_weights(name, kernels)
    with torch.no_grad():
        dx, dw, *_ = _Fp8GroupedLinearFunction.backward(ctx, dy)
    dx = dy.new_empty((0,)) if dx is None else dx
    dw = weight.new_empty((0,)) if dw is None else dw
    return dx, dw


@fp8_grouped_linear_backward.register_fake
def _(dy: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's arguments after ``dy`` (positional, as the dispatcher passes them): only shapes are read."""
    _x_data, _x_scales, weight, _counts, _experts, _name, needs = args
    dx = dy.new_empty((dy.shape[0], weight.shape[2]) if needs[0] else (0,))
    dw = weight.new_empty(tuple(weight.shape) if needs[1] else (0,))
    return dx, dw


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, weight, counts, experts, name = inputs
    _y, x_data, x_scales = output
    ctx.save_for_backward(x_data, x_scales, weight, counts)
    ctx.experts, ctx.name, ctx.x_dtype = experts, name, x.dtype
    ctx.mark_non_differentiable(x_data, x_scales)


def _backward(ctx: Any, dy: torch.Tensor, *_unused: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x_data, x_scales, weight, counts = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
    dx, dw = fp8_grouped_linear_backward(
        dy.to(ctx.x_dtype), x_data, x_scales, weight, counts, ctx.experts, ctx.name, needs
    )
    return (dx if needs[0] else None, dw if needs[1] else None, None, None, None)


fp8_grouped_linear.register_autograd(_backward, setup_context=_setup_context)
