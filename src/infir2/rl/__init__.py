"""Reinforcement learning (GRPO / DAPO) with FP8 rollouts: the recipe's third stage (`infir2 rl`, docs/RL.md)."""

from .algorithm import group_advantages, mismatch_metrics, overlong_penalty, policy_loss, tis_weights
from .config import RLConfig, load_rl_config, parse_rl_config
from .loop import RLResult, rl

__all__ = [
    "RLConfig",
    "RLResult",
    "group_advantages",
    "load_rl_config",
    "mismatch_metrics",
    "overlong_penalty",
    "parse_rl_config",
    "policy_loss",
    "rl",
    "tis_weights",
]
