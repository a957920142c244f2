"""The collapse guard: RL that un-learns says so, and (``guard.stop``) stops at its best held-out weights.

A reward that stays flat while the held-out accuracy falls is what RL from a saturated start looks like
at too high a learning rate (docs/RL.md, "Collapse guard": the demo's 2-epoch SFT start at lr 3e-4 goes
from 99% to 49% greedy in 5 steps, rollout reward flat; ``tests/fixtures/rl_collapse_two_op``). The guard
watches two numbers:

* ``val_accuracy`` -- accuracy on ``data.val_path`` (greedy, or avg@k at the rollout temperature with
  ``train.eval_samples``), measured once before step 1 (``val_start``)
  and at every evaluation (``train.eval_every`` and the last step): a fall of more than
  ``guard.max_val_drop`` below the start trips it;
* ``kl_ref`` -- the mean per-token k3 KL of the policy to the start model over the step's updates
  (a reference copy is kept when ``guard.max_kl`` is set, as for ``algo.kl_coef > 0``): above
  ``guard.max_kl`` trips it.

A trip is a warning (one line, and ``guard`` in that step's metrics); with ``guard.stop`` the run stops
after that step and ``hf/`` is exported from the weights of the best held-out accuracy seen (the start
included), named with their step in the warning and in ``<run>/guard.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import RLGuard

__all__ = ["CollapseGuard", "GuardVerdict"]


@dataclass
class GuardVerdict:
    tripped: bool
    why: str | None = None


@dataclass
class CollapseGuard:
    """What the guard has seen: the start's held-out accuracy, the best one and its step (and weights)."""

    cfg: RLGuard
    val_start: float | None = None
    best: float | None = None
    best_step: int = 0
    best_weights: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    trips: list[dict[str, Any]] = field(default_factory=list)

    def start(self, accuracy: float, model: nn.Module | None = None) -> None:
        """The held-out accuracy before any update (step 0)."""
        self.val_start = accuracy
        self._best(0, accuracy, model)

    def check(self, metrics: dict[str, Any], model: nn.Module | None = None) -> GuardVerdict:
        """Read one step's metrics (``step``, ``val_accuracy`` when measured, ``kl_ref`` when logged)."""
        step, reasons = int(metrics["step"]), []
        val = metrics.get("val_accuracy")
        if val is not None:
            self._best(step, float(val), model)
            drop = self.cfg.max_val_drop
            if drop is not None and self.val_start is not None and val < self.val_start - drop:
                reasons.append(
                    f"held-out accuracy {100 * val:.1f}% is {100 * (self.val_start - val):.1f} points below "
                    f"the start's {100 * self.val_start:.1f}% (guard.max_val_drop {100 * drop:g} points)"
                )
        kl = metrics.get("kl_ref")
        if self.cfg.max_kl is not None and kl is not None and kl > self.cfg.max_kl:
            reasons.append(f"KL to the start model {kl:.4g} > guard.max_kl {self.cfg.max_kl:g}")
        if not reasons:
            return GuardVerdict(False)
        best = "" if self.best is None else f"; best held-out {100 * self.best:.1f}% at step {self.best_step}"
        why = f"collapse guard, step {step}: " + " and ".join(reasons) + best
        self.trips.append({"step": step, "why": why})
        return GuardVerdict(True, why)

    def _best(self, step: int, accuracy: float, model: nn.Module | None) -> None:
        if self.best is not None and accuracy <= self.best:
            return
        self.best, self.best_step = accuracy, step
        if self.cfg.stop and model is not None:  # the weights hf/ is exported from when the guard stops
            self.best_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def restore_best(self, model: nn.Module) -> None:
        """Load the best held-out weights into ``model`` (``guard.stop``: before the export)."""
        if self.best_weights is not None:
            model.load_state_dict(self.best_weights)

    def write(self, path: Path, stopped: bool) -> None:
        record = {
            "val_start": self.val_start,
            "best_val_accuracy": self.best,
            "best_step": self.best_step,
            "stopped": stopped,
            "hf_from_step": self.best_step if stopped and self.best_weights is not None else None,
            "trips": self.trips,
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(path)
