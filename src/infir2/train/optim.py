"""AdamW with the recipe's parameter groups, and learning-rate schedules as pure functions of the step.

Weight decay (Megatron's rule, which the InfiR2 authors trained with): every parameter with two or
more dimensions decays -- projections, ``lm_head`` and the token embedding; one-dimensional
parameters -- RMSNorm weights and biases -- never do. Moments and master weights are fp32.

Schedules map ``step`` (0-based index of the optimizer step about to be taken) to a learning rate;
nothing is stored, so a resumed or decay-only run just evaluates the function at its step:

* ``wsd`` (warmup-stable-decay)::

      step < W                : lr * (step + 1) / W                       linear warmup
      W <= step < T - D       : lr                                         stable
      T - D <= step < T       : min_lr + (lr - min_lr) * f((step - (T - D)) / D)
                                f(p) = (1 + cos(pi p)) / 2   (cosine)   or   1 - p   (linear)

  so the first decay step runs at ``lr`` and the last (``T - 1``) at ``min_lr + (lr-min_lr) f((D-1)/D)``,
  reaching ``min_lr`` at ``T``.
* ``cosine``: linear warmup over W steps, then ``min_lr + (lr - min_lr) (1 + cos(pi p)) / 2`` with
  ``p = (step - W) / (T - W)``.
* ``constant``: linear warmup over W steps, then ``lr``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .config import OptimConfig, ScheduleConfig

__all__ = ["Schedule", "build_optimizer", "make_schedule", "param_groups"]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: >=2-D weights decay, 1-D parameters (norms, biases) do not."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over fp32 master weights; fused on CUDA unless ``cfg.fused`` says otherwise."""
    device = next(model.parameters()).device
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        fused=fused or None,
        foreach=None if fused else True,
    )


@dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule with every length resolved to steps; call it with the step."""

    name: str
    lr: float
    min_lr: float
    total_steps: int
    warmup_steps: int
    decay_steps: int = 0
    decay_style: str = "cosine"

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.name == "constant":
            return self.lr
        if self.name == "cosine":
            span = max(self.total_steps - self.warmup_steps, 1)
            return self._anneal(min((step - self.warmup_steps) / span, 1.0), "cosine")
        decay_start = self.total_steps - self.decay_steps
        if step < decay_start or self.decay_steps == 0:
            return self.lr
        return self._anneal(min((step - decay_start) / self.decay_steps, 1.0), self.decay_style)

    def _anneal(self, progress: float, style: str) -> float:
        factor = (1 + math.cos(math.pi * progress)) / 2 if style == "cosine" else 1 - progress
        return self.min_lr + (self.lr - self.min_lr) * factor


def make_schedule(cfg: ScheduleConfig, lr: float, total_steps: int) -> Schedule:
    """Resolve fractions against ``total_steps`` and ``min_lr_ratio`` against ``lr``."""
    if total_steps <= 0:
        raise ValueError(f"schedule needs a positive number of steps, got {total_steps}")
    warmup = (
        cfg.warmup_steps
        if cfg.warmup_steps is not None
        else round((cfg.warmup_fraction or 0.0) * total_steps)
    )
    if cfg.name == "wsd":
        decay = (
            cfg.decay_steps
            if cfg.decay_steps is not None
            else round((cfg.decay_fraction or 0.0) * total_steps)
        )
    else:
        decay = 0
    if warmup + decay > total_steps:
        raise ValueError(
            f"schedule: warmup ({warmup}) + decay ({decay}) steps exceed the {total_steps} training steps"
        )
    if cfg.min_lr is not None:
        min_lr = cfg.min_lr
    elif cfg.min_lr_ratio is not None:
        min_lr = cfg.min_lr_ratio * lr
    else:
        min_lr = 0.0 if cfg.name != "constant" else lr
    return Schedule(cfg.name, lr, min_lr, total_steps, warmup, decay, cfg.decay_style)
