"""Training: run configs, AdamW + schedules, the loop, metrics, distributed setup, ``infir2 train``."""

from .config import RunConfig, apply_overrides, load_config, parse_config, save_config
from .loop import NonFiniteError, TrainResult, TrainState, build_sources, evaluate, train, train_step
from .optim import Schedule, build_optimizer, make_schedule, param_groups

__all__ = [
    "NonFiniteError",
    "RunConfig",
    "Schedule",
    "TrainResult",
    "TrainState",
    "apply_overrides",
    "build_optimizer",
    "build_sources",
    "evaluate",
    "load_config",
    "make_schedule",
    "param_groups",
    "parse_config",
    "save_config",
    "train",
    "train_step",
]
