"""The process group as every layer sees it: who this process is, and the few collectives the
training loops and the sharded checkpoint format use (each the identity in a single process).

``infir2.harness.distributed.init_distributed`` builds the :class:`DistEnv`; this module imports
nothing of infir2, so the checkpoint package below ``train`` can use it.
"""

from __future__ import annotations

import functools
import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "DistEnv",
    "LaunchStore",
    "all_gather_objects",
    "all_reduce_max",
    "all_reduce_sum",
    "broadcast_object",
    "destroy_process_group",
    "gather_objects",
    "release_mesh_caches",
    "report_once",
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
        """The end of a run: destroy the process group if this run made it; otherwise let whoever made
        it destroy it for good (``release_mesh_caches``)."""
        if self.owns_group and dist.is_initialized():
            destroy_process_group()
        elif self.distributed:
            release_mesh_caches()


def release_mesh_caches() -> None:
    """Drop the references DTensor's caches (sharding propagation, redistribution plans) hold to an
    FSDP2 run's device mesh, and collect the run's model if only a reference cycle keeps it.

    Both keep the ``DeviceMesh``, hence the process group, alive past ``dist.destroy_process_group()``:
    the gloo group's worker threads then run on into interpreter exit, where one that frees a finished
    collective's tensor needs the GIL and aborts the process (SIGABRT, "terminate called without an
    active exception"; 3 of ~410 exits of a 2-process training run on a busy 2-core CPU). Clearing the
    caches costs only their refill in a later DTensor op.
    """
    try:
        from torch.distributed.tensor import _redistribute, debug
    except ImportError:  # a torch without DTensor: nothing cached
        return
    # private, so each only where this torch has it: op sharding (Python and the C++ fast path), and
    # the redistribution planners, each holding its mesh
    for name in ("_clear_sharding_prop_cache", "clear_redistribute_planner_cache"):
        clear = getattr(debug, name, None) or getattr(_redistribute, name, None)
        if clear is not None:
            clear()
    for cached in _functools_caches("torch.distributed.tensor"):  # e.g. MeshTopoInfo.build_from_mesh
        cached.cache_clear()
    gc.collect()  # a sharded model in a reference cycle (its hooks) holds the mesh too


def _functools_caches(package: str) -> list[Any]:
    """The ``functools.cache`` / ``lru_cache`` functions of ``package``'s loaded modules and their classes."""
    lru_type = type(functools.cache(len))
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        for value in list(vars(module).values()):
            members = list(vars(value).values()) if isinstance(value, type) else []
            for member in (value, *members):
                member = (
                    getattr(member, "__func__", member)
                    if isinstance(member, staticmethod | classmethod)
                    else member
                )
                if isinstance(member, lru_type):
                    found.append(member)
    return found


def destroy_process_group() -> None:
    """``dist.destroy_process_group()`` that really ends the group (its threads) when FSDP2 used it."""
    release_mesh_caches()
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


#: the type of what every rank passes to a collective of Python objects: each rank passes the same
#: variable, so rank 0's value (or any rank's) has the type the caller declared for its own
Obj = TypeVar("Obj")


def all_gather_objects(obj: Obj, env: DistEnv) -> list[Obj]:
    """Every rank's ``obj`` on every rank (list by rank)."""
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size  # filled with every rank's obj
    dist.all_gather_object(out, obj)
    return out


def gather_objects(obj: Obj, env: DistEnv) -> list[Obj] | None:
    """Every rank's ``obj`` on rank 0 (list by rank); None on the other ranks."""
    if not env.distributed:
        return [obj]
    out: list[Any] | None = [None] * env.world_size if env.is_main else None  # filled with every rank's obj
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj: Obj, env: DistEnv) -> Obj:
    """Rank 0's ``obj`` on every rank."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass(frozen=True)
class LaunchStore:
    """Where torchrun's launcher keeps its key-value store (``MASTER_ADDR`` / ``MASTER_PORT`` when
    ``TORCHELASTIC_USE_AGENT_STORE`` is set), and the run attempt keys are scoped to."""

    host: str
    port: int
    attempt: str  # the run id and restart count: a restarted attempt does not read the last one's keys


def report_once(
    line: str,
    rank: int,
    store: LaunchStore | None,
    write: Callable[[str], None],
    wait_s: float = 3.0,
) -> None:
    """Write the error ``line`` of this rank once for the whole job, not once per rank.

    Rank 0 writes it, then posts it in the launcher's store. Another rank posts its own, waits up to
    ``wait_s`` for rank 0's and writes its line (tagged ``[rank N]``) only when rank 0's differs or does
    not come (a cause of this rank alone); waiting also keeps it alive until rank 0 has written (the
    launcher ends the other workers as soon as one exits). Without a store (not under torchrun, or it
    cannot be reached) every rank writes its line, tagged.
    """
    if store is None:
        write(line if rank == 0 else f"[rank {rank}] {line}")
        return
    from datetime import timedelta

    try:
        client = dist.TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=wait_s))
    except (RuntimeError, OSError, ValueError):
        client = None
    key = f"infir2/error/{store.attempt}/"
    if rank == 0:
        write(line)
        if client is not None:
            client.set(key + "0", line)
        return
    first = None
    if client is not None:
        client.set(key + str(rank), line)
        try:
            client.wait([key + "0"], timedelta(seconds=wait_s))
            first = client.get(key + "0").decode("utf-8")
        except (RuntimeError, OSError, ValueError):  # rank 0 did not fail with a line of its own
            first = None
    if first != line:
        write(f"[rank {rank}] {line}")
