"""Training (CPT and SFT): run configs, the data sources, the loop, ``infir2 train``.

The run folder, model setup, AdamW and the schedules, checkpoints and resume, metrics and the step
guards come from the run harness (``infir2.harness``), which ``infir2 rl`` shares.
"""

from ..harness.guards import NonFiniteError
from ..harness.optim import Schedule, build_optimizer, make_schedule, param_groups
from .config import RunConfig, apply_overrides, load_config, parse_config, save_config
from .loop import TrainResult, TrainState, build_sources, evaluate, train, train_step

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
