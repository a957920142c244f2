"""An RL config as the memory planner reads it: ``plan_inputs(cfg) -> planning.RLInputs``.

The planner (``planning.rl.plan_rl``) takes a typed record, not the config: this is the one place
that reads an ``RLConfig``'s sections for it, as ``tools/plan.py`` builds a ``PlanInputs`` for a
training run. Whether the run keeps a reference copy is ``config.keeps_reference``, the rule the loop
builds the copy by.
"""

from __future__ import annotations

from ..harness.plan_settings import step_settings
from ..planning.inputs import RLInputs
from .config import RLConfig, keeps_reference

__all__ = ["plan_inputs"]


def plan_inputs(cfg: RLConfig) -> RLInputs:
    """What ``plan_rl`` needs of ``cfg``: the update's training settings, the rollout's, the reference."""
    return RLInputs(
        **step_settings(cfg.model, cfg.fp8, cfg.optim, cfg.parallel),
        micro_batch=cfg.algo.micro_batch_size,
        max_new_tokens=cfg.rollout.max_new_tokens,
        rollout_batch=cfg.rollout.batch_size,
        rollout_precision=cfg.rollout.precision,
        keeps_reference=keeps_reference(cfg),
    )
