"""Reinforcement learning (GRPO / DAPO) with FP8 rollouts: the recipe's third stage (`infir2 rl`, docs/RL.md)."""

from .algorithm import group_advantages, mismatch_metrics, overlong_penalty, policy_loss, tis_weights
from .config import RLConfig, load_rl_config, parse_rl_config
from .engine import BuiltinEngine, Rollout, RolloutEngine
from .loop import RLResult, rl
from .rewards import REWARDS

__all__ = [
    "REWARDS",
    "BuiltinEngine",
    "RLConfig",
    "RLResult",
    "Rollout",
    "RolloutEngine",
    "group_advantages",
    "load_rl_config",
    "mismatch_metrics",
    "overlong_penalty",
    "parse_rl_config",
    "policy_loss",
    "rl",
    "tis_weights",
]
