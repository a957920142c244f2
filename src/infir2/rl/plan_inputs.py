"""An RL config as the memory planner reads it: ``plan_inputs(cfg) -> planning.RLInputs``.

The planner (``planning.rl.plan_rl``) takes a typed record, not the config: this is the one place
that reads an ``RLConfig``'s sections for it, as ``tools/plan.py`` builds a ``PlanInputs`` for a
training run. Whether the run keeps a reference copy is ``config.keeps_reference``, the rule the loop
builds the copy by.
"""

from __future__ import annotations

from ..planning.inputs import RLInputs
from .config import RLConfig, keeps_reference

__all__ = ["plan_inputs"]


def plan_inputs(cfg: RLConfig) -> RLInputs:
    """What ``plan_rl`` needs of ``cfg``: the update's training settings, the rollout's, the reference."""
    m, o = cfg.model, cfg.optim
    return RLInputs(
        recipe=cfg.fp8.recipe,
        precision=m.precision,
        activation_checkpointing=m.activation_checkpointing,
        recompute_mlp=m.recompute_mlp,
        recompute_norm=m.recompute_norm,
        mlp_saved_fp8=m.mlp_saved_fp8,
        state_dtype=o.state_dtype,
        state_block=o.fp8_block,
        state_expand=o.fp8_range_expansion,
        grad_dtype=o.grad_dtype,
        context=cfg.parallel.context,
        micro_batch=cfg.algo.micro_batch_size,
        max_new_tokens=cfg.rollout.max_new_tokens,
        rollout_batch=cfg.rollout.batch_size,
        rollout_precision=cfg.rollout.precision,
        keeps_reference=keeps_reference(cfg),
    )
