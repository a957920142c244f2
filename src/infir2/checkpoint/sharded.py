"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): no rank ever holds the whole state.

A sharded checkpoint is a folder ``<run>/checkpoints/step_<8 digits>/`` holding::

    __<rank>_0.distcp    each rank's shards of the model and AdamW state (fp32), written by that rank
    .metadata            DCP's index: every tensor's global shape and which file holds which rows
    extra.pt             the small non-tensor state: scheduler, data positions and RNG states per rank,
                         train_state (step, tokens, world_size, config)
    meta.json            {"format": "dcp", "step", "world_size", "files": {name: {"bytes", "sha256"}}};
                         written last (``infir2.checkpoint.folder``: the layout of every format)

The tensor keys are those of the full-state format (``model.<HF name>``, ``optimizer.state.<HF
name>.exp_avg`` ...), so a checkpoint does not depend on the sharding: DCP reshards on load, onto any
number of ranks including one process without a process group. A tied parameter (Qwen2.5-0.5B's
``lm_head.weight`` = the embedding) is stored once, under its first name, and given back its second
name on load (checkpoints that hold both load too). A save first checks that the disk has room for
every rank's shards together and turns a full disk into one clear line (``checkpoint.space``).
Rank 0 saves ``extra.pt`` and ``meta.json``; the other ranks write only their own shards, and
nobody gathers the model.

Atomicity as in ``infir2.checkpoint.folder``: every rank writes into ``checkpoints/.tmp-step_.../``;
after all of them are done (a barrier), each rank fsyncs and hashes the files it wrote, rank 0
writes ``meta.json`` with every file's size and SHA-256, fsyncs, and renames the folder to its final
name (a kill leaves the previous checkpoints usable). ``load_sharded`` verifies every file against
``meta.json`` before reading: a damaged checkpoint is a ``ValueError``, which
``checkpoint.load_latest_valid`` turns into "skip it, try the next older one".
``async_save=True`` stages the state in CPU memory and writes it in a background thread (``dcp.async_save``): training goes on, and the returned
:class:`PendingSave` finalizes the folder (``meta.json``, rename) when it is waited on: the loop does
so at the first step after every rank's write is done (:meth:`PendingSave.ready`), before the next
save and at the end of the run at the latest. Until then the folder is a ``.tmp-*``: a crash in that
window falls back to the previous checkpoint (resumes stay exact, some steps are redone).

``load_sharded`` returns the small state of every format: ``scheduler``, ``train_state``, and
``data`` and ``rng`` as lists by saving rank (``harness.resume.data_state_for`` picks a rank's).
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.utils._pytree import tree_map_only

from .._dist import DistEnv, all_reduce_sum, broadcast_object, gather_objects
from ..nn.fsdp import Fp8ShardedWeight
from .folder import (
    FileRecord,
    Meta,
    begin,
    finish,
    is_complete,
    list_checkpoints,
    read_meta,
    record_file,
    verify,
)
from .space import InsufficientSpaceError, clear_disk_full, require_free_space, state_bytes

__all__ = [
    "FORMAT",
    "PendingSave",
    "is_sharded_checkpoint",
    "is_sharded_folder",
    "iter_model_tensors",
    "list_sharded",
    "load_sharded",
    "save_sharded",
    "verify_sharded",
]

EXTRA_FILE = "extra.pt"
FORMAT = "dcp"


def _plain(state: Any) -> Any:
    """The state with FP8 all-gather wrappers (``infir2.nn.fsdp``) replaced by the tensors they wrap,
    so that the files hold ordinary tensors (and DCP reads into the wrapped storage)."""
    from torch.distributed.tensor import DTensor

    def unwrap(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor) and isinstance(t._local_tensor, Fp8ShardedWeight):
            return DTensor.from_local(
                t._local_tensor._tensor,
                t.device_mesh,
                t.placements,
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
        return t

    return tree_map_only(torch.Tensor, unwrap, state)


def _tied_names(model: nn.Module) -> dict[str, str]:
    """``{second name: first name}`` of parameters shared under two names (a tied ``lm_head.weight``)."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def _without_tied(model: nn.Module, model_sd: dict[str, Any]) -> dict[str, Any]:
    """The model state dict without the second name of a tied parameter: DCP would store it twice
    (+9% of a checkpoint for Qwen2.5-0.5B's embedding); :func:`_with_tied` puts it back on load."""
    tied = _tied_names(model)
    return {k: v for k, v in model_sd.items() if not (k in tied and tied[k] in model_sd)}


def _with_tied(model: nn.Module, model_sd: dict[str, Any]) -> dict[str, Any]:
    return model_sd | {k: model_sd[v] for k, v in _tied_names(model).items() if v in model_sd}


def _barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def _writer(name: str, env: DistEnv) -> int:
    """The rank that wrote (and hashes) a checkpoint file: DCP names each rank's data ``__<rank>_<i>.distcp``."""
    match = re.match(r"__(\d+)_", name)
    return int(match.group(1)) if match and int(match.group(1)) < env.world_size else 0


_ASYNC_GROUPS: dict[int, Any] = {}


def _async_group() -> Any:
    """A gloo group of its own for the background writer's collectives (as torchtitan does): on the
    default group they would interleave with the training step's and deadlock. Created once per
    default group (``new_group`` is collective: every rank reaches it in the same save)."""
    key = id(dist.group.WORLD)
    if key not in _ASYNC_GROUPS:
        _ASYNC_GROUPS.clear()  # groups of a destroyed default group
        _ASYNC_GROUPS[key] = dist.new_group(backend="gloo")
    return _ASYNC_GROUPS[key]


@dataclass
class PendingSave:
    """A save in progress; :meth:`wait` (every rank) finishes it and returns the checkpoint folder."""

    future: Future[Any] | None
    finalize: Any  # () -> Path | None, run on every rank after the write
    #: around the background write's result: a full disk becomes one clear line (``checkpoint.space``)
    guard: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext

    def ready(self, env: DistEnv) -> bool:
        """True on every rank once every rank's write is done (one tiny all-reduce: all ranks call).

        The loop asks after each step and finalizes a finished async save then, so that a crash
        soon after loses nothing; :meth:`wait` would block instead."""
        not_done = torch.tensor(
            [0.0 if self.future is None or self.future.done() else 1.0], device=env.device
        )
        return float(all_reduce_sum(not_done, env)) == 0.0

    def wait(self) -> Path:
        if self.future is not None:
            with self.guard():
                self.future.result()
        return self.finalize()


def save_sharded(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    env: DistEnv,
    keep_last: int | None = None,
    async_save: bool = False,
) -> PendingSave:
    """Write ``root/step_<step>`` (every rank calls). ``extra``: this rank's small state; rank 0's
    ``scheduler`` and ``train_state``, every rank's ``data`` and ``rng`` are kept."""
    tmp, final = begin(root, step) if env.is_main else (None, None)
    tmp, final = broadcast_object((tmp, final), env)
    assert isinstance(tmp, Path) and isinstance(final, Path)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # this rank's shards (DTensors), no gather
    state = _plain({"model": _without_tied(model, model_sd), "optimizer": optim_sd})
    nbytes, what = state_bytes(state), f"checkpoint {final.name}"  # every rank's shards together
    _require_room(tmp, final.parent, nbytes, what, env)
    per_rank = gather_objects({"data": extra.get("data"), "rng": extra.get("rng")}, env)
    if env.is_main:
        assert per_rank is not None
        small = {
            "scheduler": extra.get("scheduler"),
            "train_state": {**extra.get("train_state", {}), "world_size": env.world_size},
            "data": [r["data"] for r in per_rank],
            "rng": [r["rng"] for r in per_rank],
        }
        torch.save(small, tmp / EXTRA_FILE)

    def finalize() -> Path:
        _barrier(env)  # every rank's shards are on disk
        # each rank fsyncs and hashes the files it wrote (__<rank>_*.distcp; rank 0 also the rest):
        # the checksums cost one read of the checkpoint in all, spread over the ranks
        mine = [p.name for p in sorted(tmp.iterdir()) if _writer(p.name, env) == env.rank]
        records = gather_objects({name: record_file(tmp / name) for name in mine}, env)
        if env.is_main:
            assert records is not None
            files: dict[str, FileRecord] = {k: v for r in records for k, v in r.items()}
            finish(tmp, final, Meta(FORMAT, step, env.world_size, files), keep_last)
        return broadcast_object(final, env)

    no_dist = not env.distributed
    mine_tmp = tmp if env.is_main else None  # rank 0 removes a failed save's folder
    if async_save:  # state staged (copied) to CPU memory here, written by a background thread
        group = _async_group() if env.distributed else None
        started = dcp.async_save(state, checkpoint_id=tmp, no_dist=no_dist, process_group=group)
        done = started.upload_completion if isinstance(started, AsyncSaveResponse) else started
        return PendingSave(done, finalize, lambda: clear_disk_full(mine_tmp, final.parent, nbytes, what))
    with clear_disk_full(mine_tmp, final.parent, nbytes, what):
        dcp.save(state, checkpoint_id=tmp, no_dist=no_dist)
    written = finalize()  # a synchronous save is a checkpoint when it returns
    return PendingSave(None, lambda: written)


def _require_room(tmp: Path, folder: Path, nbytes: int, what: str, env: DistEnv) -> None:
    """Rank 0 checks the disk's free space for the whole checkpoint; every rank raises the same error."""
    problem = None
    if env.is_main:
        try:
            require_free_space(folder, nbytes, what)
        except InsufficientSpaceError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            problem = str(e)
    problem = broadcast_object(problem, env)
    if problem is not None:
        raise InsufficientSpaceError(problem)


def is_sharded_checkpoint(path: str | Path) -> bool:
    """True for a complete DCP checkpoint folder (the sizes in ``meta.json`` match the files on disk;
    the cheap check used for listing, :func:`verify_sharded` is the full one)."""
    return is_complete(path, FORMAT)


def is_sharded_folder(path: str | Path) -> bool:
    """True when ``meta.json`` says the folder is a DCP checkpoint (complete or not)."""
    try:
        return read_meta(path).format == FORMAT
    except ValueError:
        return False


def verify_sharded(path: str | Path) -> None:
    """Raise ValueError unless every file of the checkpoint has the size and SHA-256 of ``meta.json``."""
    verify(path, FORMAT)


def list_sharded(root: str | Path) -> list[Path]:
    """Complete sharded checkpoints under ``root``, oldest first."""
    return list_checkpoints(root, FORMAT)


def load_sharded(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv
) -> dict[str, Any]:
    """Load a sharded checkpoint into ``model`` (and ``optimizer``) on any number of ranks; returns
    the small state (``scheduler``, ``train_state``, ``data`` and ``rng`` lists by saving rank)."""
    path = Path(path)
    verify_sharded(path)
    if optimizer is None:
        model_sd, _ = get_state_dict(model, [])
        state: dict[str, Any] = {"model": _without_tied(model, model_sd)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)  # templates: this rank's shapes
        state = {"model": _without_tied(model, model_sd), "optimizer": optim_sd}
    state = _plain(state)
    dcp.load(state, checkpoint_id=path, no_dist=not env.distributed)  # reads only this rank's rows
    state["model"] = _with_tied(model, state["model"])  # a tied parameter is stored once
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    extra: dict[str, Any] = torch.load(path / EXTRA_FILE, map_location="cpu", weights_only=True)
    return extra


def iter_model_tensors(
    path: str | Path, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` of each model tensor of a sharded checkpoint, one at a time (for an
    export: at most one full tensor is in memory per call). Reads without a process group."""
    from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

    path = Path(path)
    metadata = FileSystemReader(path).read_metadata()
    for key, item in metadata.state_dict_metadata.items():
        if not key.startswith("model.") or not isinstance(item, TensorStorageMetadata):
            continue
        tensor = torch.empty(item.size, dtype=item.properties.dtype)
        dcp.load({key: tensor}, checkpoint_id=path, no_dist=True)
        yield key[len("model.") :], tensor if dtype is None else tensor.to(dtype)
