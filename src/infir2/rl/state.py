"""What an RL run carries from step to step: its counters, its data state and what a step works with.

``RLState`` (the counters, saved under ``train_state``), ``RolloutData`` (prompt order, sampler and the
dynamic-sampling buffer: the run's named data state, ``harness.resume.Resumable``) and ``Run`` (the
config, the process group and its data x context layout, the policy and its optimizer, the rollout engine
and reference, the prompts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..generation import RolloutEngine
from ..harness.distributed import ContextLayout, DistEnv
from ..harness.resume import Replicated, SavePolicy
from ..tasks import Problem
from .batch import Group
from .config import RLConfig
from .prompts import PromptStream

__all__ = ["RLState", "RolloutData", "Run"]


@dataclass
class RLState:
    """The loop's counters; saved under ``train_state`` in every checkpoint."""

    step: int = 0
    updates: int = 0  # optimizer steps done (skipped ones included)
    samples_seen: int = 0
    skipped_total: int = 0
    skipped_in_row: int = 0


class RolloutData(Replicated):
    """The run's data state (``harness.resume.Resumable``): prompt order, sampler, dynamic-sampling buffer.

    The same on every rank (``harness.resume.Replicated``): one copy is saved."""

    def __init__(self, stream: PromptStream, sampler: torch.Generator) -> None:
        self.stream, self.sampler = stream, sampler
        self.buffer: list[Group] = []

    def state_dict(self) -> dict[str, Any]:
        buffer = [g.to_record() for g in self.buffer]
        return {"prompts": self.stream.state_dict(), "buffer": buffer, "sampler": self.sampler.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["prompts"])
        self.buffer[:] = [Group.from_record(r) for r in state["buffer"]]
        self.sampler.set_state(state["sampler"])


@dataclass(kw_only=True)
class Run:
    """What a step works with (built once by ``_setup``; keyword-only: fifteen fields, several of one type)."""

    cfg: RLConfig
    env: DistEnv
    model: nn.Module
    optimizer: torch.optim.Optimizer
    tokenizer: Any
    engine: RolloutEngine
    ref: nn.Module | None
    problems: list[Problem]
    prompt_ids: list[list[int]]
    data: RolloutData
    stop_ids: list[int]
    pad_id: int
    val: list[Problem]
    val_ids: list[list[int]]
    context: ContextLayout  # parallel.context: this rank's data replica and context rank (rl/context.py)

    @property
    def policy(self) -> SavePolicy:
        return SavePolicy(self.cfg.run_dir / "checkpoints", "full", self.cfg.train.keep_last)
