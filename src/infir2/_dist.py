"""The process group as every layer sees it: who this process is, and the few collectives the
training loops and the sharded checkpoint format use (each the identity in a single process).

``infir2.harness.distributed.init_distributed`` builds the :class:`DistEnv`; this module imports
nothing of infir2, so the checkpoint package below ``train`` can use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "DistEnv",
    "all_gather_objects",
    "all_reduce_max",
    "all_reduce_sum",
    "broadcast_object",
    "gather_objects",
]


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool  # True when init_distributed created the process group (and must destroy it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a tensor over ranks (identity in a single process)."""
    if env.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def all_reduce_max(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Elementwise maximum of a tensor over ranks (identity in a single process)."""
    if env.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def all_gather_objects(obj: object, env: DistEnv) -> list[object]:
    """Every rank's ``obj`` on every rank (list by rank)."""
    if not env.distributed:
        return [obj]
    out: list[object] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def gather_objects(obj: object, env: DistEnv) -> list[object] | None:
    """Every rank's ``obj`` on rank 0 (list by rank); None on the other ranks."""
    if not env.distributed:
        return [obj]
    out: list[object] | None = [None] * env.world_size if env.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj: object, env: DistEnv) -> object:
    """Rank 0's ``obj`` on every rank."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
