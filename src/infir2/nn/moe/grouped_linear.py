"""``fp8_grouped_linear``: rows sorted by expert through one 3-D weight, the three GEMMs in FP8 per expert.

``x [S, K]`` holds the rows routed to each expert, sorted by expert (``counts[e]`` rows for expert e),
and ``weight [E, N, K]`` one ``[N, K]`` weight per expert; the dense recipe runs per expert::

    fprop  Y_e  = Q(X_e, 1x128)  @ Q(W_e, 128x128).T      [S_e,K] @ [K,N] -> [S_e,N]
    dgrad  dX_e = Q(dY_e, 1x128) @ Q(W_e, 128x128)        [S_e,N] @ [N,K] -> [S_e,K]
    wgrad  dW_e = Q(dY_e, 128x1).T @ Q(X_e, 128x1)        [N,S_e] @ [S_e,K] -> [N,K]

The 128x1 wgrad tiles run along each expert's own rows, so no tile mixes experts; an expert with no
row runs no GEMM and gets a zero weight gradient. What backward keeps per expert is the FP8 wgrad copy
of its rows, as for a dense layer. ``Fp8Experts`` (``infir2.nn.moe.experts``) calls it for each of its
two projections; under ``torch.compile`` its custom ops (``infir2.nn.moe.ops``) run this function's
forward and backward inside.
"""

from __future__ import annotations

from typing import Any

import torch

from ...fp8.accumulate import accumulation_dtype, no_autocast
from ...fp8.recipe import Fp8Recipe
from ...kernels import Kernels, Operand
from ...kernels.grouped import gemm_nt_grouped, group_bounds, quantize_pair_groups
from ..module import Recorder
from .telemetry import ExpertsProbe

__all__ = ["fp8_grouped_linear"]


class _Fp8GroupedLinearFunction(torch.autograd.Function):
    """``Y[rows_e] = X[rows_e] @ W[e].T`` per expert, the three GEMMs in FP8 (module doc)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        counts: list[int],
        recipe: Fp8Recipe,
        kernels: Kernels,
        w_ops: list[Operand],
        stats: Recorder | None = None,
    ) -> torch.Tensor:
        with no_autocast(x.device):  # the GEMMs as written (fp32 sums) under autocast too
            bounds = group_bounds(counts)
            x_ops = quantize_pair_groups(kernels, x, bounds, recipe.x, recipe.x_wgrad)  # per expert [S_e,K]
            y = gemm_nt_grouped(
                kernels, [o[0] if o else None for o in x_ops], w_ops, x.dtype, x
            )  # [S,K] -> [S,N], per expert [S_e,K] @ [K,N], fp32 accumulate
            ctx.probe = ExpertsProbe(stats, recipe, weight, bounds) if stats is not None else None
            if ctx.probe is not None:  # telemetry on a stats step only: reads the operands, changes nothing
                ctx.probe.forward(x, x_ops, w_ops, y)
            saved = [t for o in x_ops if o is not None for t in (o[1].data, o[1].scale_inv)]
            reuse = recipe.reuses_weight
            ctx.w_kept = w_ops if reuse and all(w.keep_for_backward for w in w_ops) else None
            w_saved = (
                [t for w in w_ops for t in (w.data, w.scale_inv)] if reuse and ctx.w_kept is None else []
            )
            ctx.save_for_backward(weight, *saved, *w_saved)
            ctx.n_x, ctx.bounds, ctx.recipe, ctx.kernels, ctx.x_dtype = (
                len(saved),
                bounds,
                recipe,
                kernels,
                x.dtype,
            )
            return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with no_autocast(dy.device):
            recipe: Fp8Recipe = ctx.recipe
            kernels: Kernels = ctx.kernels
            weight, *rest = ctx.saved_tensors
            x_saved, w_saved = rest[: ctx.n_x], rest[ctx.n_x :]
            need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            dy_ops = quantize_pair_groups(
                kernels, dy, ctx.bounds, recipe.dy, recipe.dy_wgrad
            )  # per expert [S_e,N]
            dx = dw = w_dgrad = None
            if need_dx:
                w_dgrad = _dgrad_weights(ctx, weight, w_saved)
                dx = gemm_nt_grouped(
                    kernels, [o[0] if o else None for o in dy_ops], [w.t() for w in w_dgrad], ctx.x_dtype, dy
                )  # per expert [S_e,N] @ [N,K] -> [S_e,K], fp32 accumulate
            if need_dw:
                dw = _wgrad(kernels, recipe, weight, dy_ops, x_saved)
            if ctx.probe is not None:
                ctx.probe.backward(dy, dy_ops, w_dgrad, dx, dw)
            return dx, dw, None, None, None, None, None


def _dgrad_weights(ctx: Any, weight: torch.Tensor, w_saved: list[torch.Tensor]) -> list[Operand]:
    """The per-expert dgrad weights: the forward's (kept or saved) or quantized again for another cast."""
    if ctx.w_kept is not None:
        return ctx.w_kept
    block = ctx.recipe.w_dgrad.block
    if w_saved:
        return [Operand(w_saved[2 * e], w_saved[2 * e + 1], block) for e in range(weight.shape[0])]
    with torch.no_grad():
        return [ctx.kernels.quantize(weight[e].detach(), ctx.recipe.w_dgrad) for e in range(weight.shape[0])]


def _wgrad(
    kernels: Kernels,
    recipe: Fp8Recipe,
    weight: torch.Tensor,
    dy_ops: list[tuple[Operand, Operand] | None],
    x_saved: list[torch.Tensor],
) -> torch.Tensor:
    """``dW[e] = Q(dY_e, 128x1).T @ Q(X_e, 128x1)``; zero for an expert without rows."""
    dw = torch.zeros(
        weight.shape, dtype=weight.dtype, device=weight.device
    )  # (not a gathered FP8 weight's kind)
    i = 0
    for e, ops in enumerate(dy_ops):
        if ops is None:
            continue
        x_w = Operand(x_saved[i], x_saved[i + 1], recipe.x_wgrad.block)  # [S_e, K]
        i += 2
        dw[e] = kernels.gemm_nt(
            ops[1].t(), x_w.t(), accumulation_dtype(weight.dtype)
        )  # [N,S_e] @ [S_e,K] -> [N,K], fp32 accumulate
    return dw


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: list[int],
    recipe: Fp8Recipe,
    kernels: Kernels,
    w_ops: list[Operand] | None = None,
    stats: Recorder | None = None,
) -> torch.Tensor:
    """``x [S, K]`` (rows sorted by expert, ``counts[e]`` rows for expert e) through ``weight [E, N, K]``
    in FP8: ``[S, N]``. ``w_ops``: the per-expert quantized weights (quantized here when not given);
    ``stats``: a telemetry recorder (``infir2.nn.moe.telemetry``) on a stats step."""
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if len(counts) != weight.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped linear: {x.shape[0]} rows, {weight.shape[0]} experts, counts {counts}")
    if w_ops is None:
        with torch.no_grad():
            w_ops = [kernels.quantize(weight[e].detach(), recipe.w) for e in range(weight.shape[0])]
    out: torch.Tensor = _Fp8GroupedLinearFunction.apply(x, weight, counts, recipe, kernels, w_ops, stats)
    return out
