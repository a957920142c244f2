"""The training settings the memory planner models, read once from the sections every stage shares.

``infir2 plan --train`` (``planning.PlanInputs``) and RL's planner record (``planning.RLInputs``, built in
``rl.plan_inputs``) name them alike; both take them from here, so a setting the planner learns to model is
read from a config in one place.
"""

from __future__ import annotations

from typing import Any

from .config import Fp8Config, ModelConfig, OptimConfig, ParallelConfig

__all__ = ["step_settings"]


def step_settings(
    model: ModelConfig, fp8: Fp8Config, optim: OptimConfig, parallel: ParallelConfig
) -> dict[str, Any]:
    """The recipe, ``model.precision`` (as written: fp64 included), checkpointing and the recomputes, the
    optimizer's state and gradient storage, and the context degree, by the planner's field names."""
    return {
        "recipe": fp8.recipe,
        "precision": model.precision,
        "activation_checkpointing": model.activation_checkpointing,
        "recompute_mlp": model.recompute_mlp,
        "recompute_norm": model.recompute_norm,
        "mlp_saved_fp8": model.mlp_saved_fp8,
        "state_dtype": optim.state_dtype,
        "state_block": optim.fp8_block,
        "state_expand": optim.fp8_range_expansion,
        "grad_dtype": optim.grad_dtype,
        "context": parallel.context,
    }
