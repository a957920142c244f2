"""AdamW with the recipe's parameter groups, and learning-rate schedules as pure functions of the step.

Weight decay (Megatron's rule, which the InfiR2 authors trained with): every parameter with two or
more dimensions decays -- projections, ``lm_head`` and the token embedding; one-dimensional
parameters -- RMSNorm weights and biases -- never do. Master weights are fp32; the two AdamW moments
are fp32 (``optim.state_dtype: fp32``, torch's AdamW: 4 + 4 + 4 + 4 = 16 bytes per parameter with the
gradient) or bf16 (``optim.state_dtype: bf16``, ``LowPrecisionAdamW``, as Megatron's
``--exp-avg-dtype/--exp-avg-sq-dtype bf16``: 12 bytes per parameter). The bf16 moments are only
storage: each step upcasts them to fp32, runs the same AdamW math as torch in fp32, and rounds the new
moments back (round-to-nearest-even); the update itself never sees a bf16 value.

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
from typing import Any

import torch
from torch import nn

from .config import OptimConfig, ScheduleConfig

__all__ = ["LowPrecisionAdamW", "Schedule", "build_optimizer", "make_schedule", "param_groups"]


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


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (decoupled decay, bias-corrected) with its moments stored in ``state_dtype``, math in fp32.

    Per parameter ``p`` with gradient ``g`` at step ``t`` (torch's AdamW, ``amsgrad=False``)::

        p *= 1 - lr * wd;   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    with ``m``, ``v`` read from and written back to ``state_dtype`` tensors. The state dict has torch
    AdamW's keys (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints load either way round.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        state_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype

    def _moments(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(
                p, dtype=self.state_dtype, memory_format=torch.preserve_format
            )
            state["exp_avg_sq"] = torch.zeros_like(
                p, dtype=self.state_dtype, memory_format=torch.preserve_format
            )
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._moments(p)
                state["step"] += 1
                t = float(state["step"])
                g = p.grad.float()
                m = state["exp_avg"].float().lerp_(g, 1 - beta1)
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                p.mul_(1 - lr * wd)
                denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader casts moments to the parameter dtype (fp32); store them back in ``state_dtype``."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.state_dtype)


STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over fp32 master weights; fused on CUDA unless ``cfg.fused`` says otherwise.

    ``cfg.state_dtype == "bf16"``: ``LowPrecisionAdamW`` (bf16 moments; ``fused`` does not apply).
    """
    device = next(model.parameters()).device
    if cfg.state_dtype != "fp32":
        return LowPrecisionAdamW(
            param_groups(model, cfg.weight_decay),
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            state_dtype=STATE_DTYPES[cfg.state_dtype],
        )
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
