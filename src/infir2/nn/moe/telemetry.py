"""FP8 numerics telemetry of the experts (``fp8.stats_every``): one recorder per expert weight, over all experts.

``infir2.nn.telemetry.Fp8Telemetry`` attaches a ``LayerStats`` to each of an ``Fp8Experts``' two
weights on a stats step (keys ``fp8/<experts fqn>.gate_up_proj/<gemm>.<operand>/<stat>``); the
grouped linear hands it every expert's operands, so each statistic covers the weight's experts
together (amax the largest, fractions over all their elements, the scale-exponent range over all
their blocks), and each SQNR compares the grouped result with the per-expert fp32 GEMMs of the
unquantized operands, on the step's first micro-batch. A weight all-gathered as FP8 codes has no
high-precision copy: its ``w`` statistics and the SQNRs are not recorded, as for dense layers.
Under ``torch.compile`` nothing of the experts is recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...fp8.recipe import Cast, Fp8Recipe
from ...kernels import Operand
from ..fsdp import Fp8GatheredWeight
from ..module import Recorder

__all__ = ["ExpertsProbe"]

Bounds = Sequence[tuple[int, int]]
Pairs = Sequence[tuple[Operand, Operand] | None]


def _add_rows(
    stats: Recorder, name: str, t: torch.Tensor, bounds: Bounds, ops: Pairs, i: int, cast: Cast
) -> None:
    for (s, e), pair in zip(bounds, ops, strict=True):
        if pair is not None:
            stats.add(name, t[s:e], pair[i], cast)


class ExpertsProbe:
    """Records one grouped linear's forward, and then its backward (holds X for the SQNR micro-batch)."""

    def __init__(self, stats: Recorder, recipe: Fp8Recipe, weight: torch.Tensor, bounds: Bounds) -> None:
        self.stats, self.recipe, self.weight, self.bounds = stats, recipe, weight, bounds
        self.hp_weight = not isinstance(weight, Fp8GatheredWeight)
        self.x: torch.Tensor | None = None

    def _per_expert(self, a: torch.Tensor, fn: Any) -> list[torch.Tensor]:
        return [fn(a[s:e], self.weight[g].detach().float()) for g, (s, e) in enumerate(self.bounds) if e > s]

    def forward(self, x: torch.Tensor, x_ops: Pairs, w_ops: Sequence[Operand], y: torch.Tensor) -> None:
        s, r = self.stats, self.recipe
        _add_rows(s, "fprop.x", x, self.bounds, x_ops, 0, r.x)
        _add_rows(s, "wgrad.x", x, self.bounds, x_ops, 1, r.x_wgrad)
        if not self.hp_weight:
            return
        for g, w in enumerate(w_ops):
            s.add("fprop.w", self.weight[g], w, r.w)
        if not s.sqnr_taken and y.shape[0]:
            s.sqnr_taken, self.x = True, x.detach()
            ref = torch.cat(self._per_expert(x, lambda a, w: a.float() @ w.t()))  # [S_e,K] @ [K,N] each
            s.add_sqnr("fprop.y", ref, y)

    def backward(
        self, dy: torch.Tensor, dy_ops: Pairs, w_dgrad: Sequence[Operand] | None, dx: Any, dw: Any
    ) -> None:
        s, r = self.stats, self.recipe
        _add_rows(s, "dgrad.dy", dy, self.bounds, dy_ops, 0, r.dy)
        _add_rows(s, "wgrad.dy", dy, self.bounds, dy_ops, 1, r.dy_wgrad)
        if self.hp_weight and w_dgrad is not None:
            for g, w in enumerate(w_dgrad):
                s.add("dgrad.w", self.weight[g], w, r.w_dgrad)
        if self.x is None:
            return
        if dx is not None:  # [S_e,N] @ [N,K] each
            s.add_sqnr("dgrad.dx", torch.cat(self._per_expert(dy, lambda a, w: a.float() @ w)), dx)
        if dw is not None:  # [N,S_e] @ [S_e,K] per expert, zero without rows
            ref = torch.zeros(self.weight.shape, dtype=torch.float32, device=dy.device)
            for g, (st, e) in enumerate(self.bounds):
                ref[g] = dy[st:e].float().t() @ self.x[st:e].float()
            s.add_sqnr("wgrad.dw", ref, dw)
        self.x = None
