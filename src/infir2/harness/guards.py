"""The step guards every stage shares: the gradient norm, skipped-step streaks, a spike rule.

* ``clip_grad_norm`` -- the global gradient norm (over all shards under FSDP2), clipped to ``max_norm``
  (0: no clipping); a stage skips its update when the norm or the loss is not finite. The squares are
  summed in float64, per tensor and then over tensors and ranks: torch's fp32 ``vector_norm`` /
  ``_foreach_norm`` (what ``clip_grad_norm_`` uses) accumulates in fp32 on CPUs, 2e-4 low at 4M elements
  and 1e-3 at 16M (one embedding's gradient), and by a different amount on each shard -- so the clip
  factor, and then the weights, depended on the number of processes;
* ``SpikeRule`` -- a statistic more than ``margin`` above the median of its last ``window`` healthy
  values is a spike (``infir2 train``: the loss, 3 nats; a likelihood that jumps by e^3 = 20x is
  divergence, not noise); infinite without history, so it never fires on the first steps;
* ``StepGuard`` -- counts skipped steps, whatever skipped them (``state.skipped_total`` /
  ``skipped_in_row``, saved with the counters), says why in one line, and stops the run with
  ``NonFiniteError`` after ``max_in_row`` in a row, naming the last checkpoint written before the
  streak (none is written during one, so ``keep_last`` never deletes it).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .grads import grad_of

__all__ = ["NonFiniteError", "SpikeRule", "StepGuard", "clip_grad_norm", "grad_norm"]


class NonFiniteError(ValueError):
    """Too many consecutive skipped steps (a non-finite loss or gradient norm, or a spike).

    A ``ValueError``: the CLI prints it as one line (exit code 2). It names the last checkpoint written
    before the streak.
    """


#: elements squared at a time in float64 (a bounded temporary whatever the tensor's size)
NORM_CHUNK = 1 << 24


def _local(grad: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A gradient's local values and whether they are a shard of a DTensor (summed over ranks)."""
    if hasattr(grad, "to_local"):
        return grad.to_local(), True
    return grad, False


def _sum_of_squares(values: torch.Tensor) -> torch.Tensor:
    flat = values.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=values.device)
    for chunk in flat.split(NORM_CHUNK):
        total += chunk.double().square().sum()
    return total


def grad_norm(model: nn.Module) -> float:
    """The global L2 norm of ``model``'s gradients: float64 sums of squares, over every shard."""
    grads = [g for g in map(grad_of, model.parameters()) if g is not None]
    if not grads:
        return 0.0
    locals_ = [_local(g) for g in grads]
    device = locals_[0][0].device
    total = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for values, sharded in locals_:
        if sharded:
            total += _sum_of_squares(values)
        else:
            replicated += _sum_of_squares(values)
    if any(sharded for _, sharded in locals_) and dist.is_initialized():
        dist.all_reduce(total)  # the shards of every rank (FSDP2 shards each parameter over all ranks)
    return math.sqrt(float(total + replicated))


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """The global gradient norm of ``model`` (``grad_norm``); gradients scaled by ``max_norm / (norm + 1e-6)``
    when that is below 1 (torch's rule; ``max_norm`` 0: no clipping). Returns the norm before clipping."""
    norm = grad_norm(model)
    coef = max_norm / (norm + 1e-6)
    if max_norm > 0 and coef < 1 and math.isfinite(norm):
        for g in map(grad_of, model.parameters()):
            if g is not None:
                g.mul_(coef)
    return norm


class SpikeRule:
    """``margin`` above the median of the last ``window`` observed values is a spike (None: off)."""

    def __init__(self, margin: float | None, window: int) -> None:
        self.margin = margin
        self.recent: deque[float] = deque(maxlen=window)

    def limit(self) -> float:
        """The value above which this step is a spike (inf without history or when off)."""
        if self.margin is None or not self.recent:
            return math.inf
        return statistics.median(self.recent) + self.margin

    def reference(self) -> float:
        """The median the limit is measured from."""
        return self.limit() - (self.margin or 0.0)

    def observe(self, value: float) -> None:
        """Record the value of a step that was not skipped."""
        self.recent.append(value)


class StepGuard:
    """Counts skipped steps in ``state`` and stops the run after ``max_in_row`` in a row.

    ``key``: the config key of ``max_in_row``; ``causes``: what skips a step in this stage; ``advice``:
    what to try (each stage knows its knobs)."""

    def __init__(self, max_in_row: int, key: str, causes: str, advice: str) -> None:
        self.max_in_row, self.key, self.causes, self.advice = max_in_row, key, causes, advice

    def record(self, state: Any, why: str | None, message: Any, last_checkpoint: Path | None) -> None:
        """``why``: the reason this step was skipped, or None (a healthy step ends a streak).
        ``message``: where the line goes (the metrics logger's ``message``)."""
        if why is None:
            state.skipped_in_row = 0
            return
        state.skipped_total += 1
        state.skipped_in_row += 1
        message(
            f"step {state.step}: {why}: update skipped ({state.skipped_in_row} in a row, "
            f"{state.skipped_total} in total)"
        )
        if state.skipped_in_row < self.max_in_row:
            return
        where = (
            f"the last checkpoint written before the streak is {last_checkpoint}"
            if last_checkpoint
            else "no checkpoint was written before the streak"
        )
        raise NonFiniteError(
            f"stopping at step {state.step}: {state.skipped_in_row} steps in a row had {self.causes} "
            f"({self.key}={self.max_in_row}; last: {why}); {where}. {self.advice}"
        )
