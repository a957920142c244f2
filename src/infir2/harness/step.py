"""The parts of an update step every stage shares (``train.loop.train_step``, ``rl.update.update``).

* ``loss_scale`` -- each micro-batch's summed token loss is backpropagated times ``world_size / tokens``
  (``tokens``: the loss tokens of the whole batch, every rank's): FSDP2 averages the gradients over the
  ranks, so the step's gradient is that of the per-token mean over the batch, whatever the world size;
* ``rounding_noise`` -- the stochastic rounding of a micro-batch (``fp8.recipe: nvfp4``) draws from a
  generator seeded by the step's seed (``step_seed``: the run's seed and the step) and the micro-batch's
  place in the step (``infir2.fp8.nvfp4``), never from torch's global generator: the draws depend on
  nothing else, so N processes, and a resumed run, draw what one uninterrupted process draws;
* ``apply_update`` -- the tail: the gradient norm clipped (``guards.clip_grad_norm``), one optimizer
  step at ``lr`` when the loss and the norm are finite (and the stage does not hold it back: a spike,
  no tokens), the gradients freed either way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..fp8 import nvfp4
from .guards import clip_grad_norm

__all__ = ["Update", "apply_update", "loss_scale", "rounding_noise", "step_seed"]


def loss_scale(world_size: int, tokens: float) -> float:
    """The factor of a micro-batch's summed token loss: ``world_size`` over the batch's ``tokens`` (at
    least 1) on every rank (module doc)."""
    return world_size / max(tokens, 1)


def step_seed(run_seed: int, step: int) -> int:
    """The rounding-noise seed of optimizer step ``step`` (0-based, the steps done before it)."""
    return nvfp4.noise_seed(run_seed, step)


@contextmanager
def rounding_noise(seed: int | None, *place: int, device: torch.device) -> Iterator[None]:
    """Stochastic rounding inside the block draws from a generator on ``device`` seeded by ``seed`` and
    the micro-batch's ``place`` in the step (e.g. its index in the global batch); ``seed=None``: from
    torch's generator, as without the block."""
    if seed is None:
        yield
        return
    with nvfp4.noise_generator(torch.Generator(device).manual_seed(nvfp4.noise_seed(seed, *place))):
        yield


@dataclass(frozen=True)
class Update:
    """What ``apply_update`` did: the norm before clipping, whether loss and norm were finite, whether
    the optimizer stepped."""

    grad_norm: float
    finite: bool
    stepped: bool


def apply_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss: float,
    lr: float,
    grad_clip: float,
    hold: bool = False,
) -> Update:
    """Clip the gradients of ``model`` to ``grad_clip`` (0: no clipping), then one ``optimizer`` step at
    ``lr`` unless ``loss`` or the norm is not finite or the stage ``hold``s it back; the gradients are
    freed in every case."""
    norm = clip_grad_norm(model, grad_clip)
    finite = math.isfinite(loss) and math.isfinite(norm)
    stepped = finite and not hold
    if stepped:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return Update(norm, finite, stepped)
