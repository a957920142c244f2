"""The ``full`` checkpoint format: the whole training state in one ``state.pt``, written by rank 0.

``state.pt`` is a ``torch.save`` of::

    {"model":       full (unsharded) model state dict, fp32 masters, nn.Linear keys,
     "optimizer":   full optimizer state dict keyed by parameter name (AdamW moments, fp32),
     "scheduler":   {"step": steps done} -- schedules are pure functions of the step,
     "data":        [StepSource.state_dict() of rank 0, rank 1, ...],
     "train_state": {"step", "tokens_seen", "skipped_total", "skipped_in_row", "world_size",
                     "rng": [per-rank RNG states], "config": resolved run config}}

in a folder of ``infir2.checkpoint.folder`` (atomic write, ``meta.json`` with its size and SHA-256).
Full state dicts (gathered to rank 0 by ``torch.distributed.checkpoint.state_dict``) make a
checkpoint independent of the sharding: it loads on any number of ranks (the data position needs
the same world size) and in a plain single-process ``torch.load``. The cost is that rank 0 holds the
whole state in CPU memory while saving (about 12 bytes per parameter) -- fine up to a few billion
parameters; beyond that use the sharded format (``train.checkpoint_format: dcp``,
``infir2.checkpoint.sharded``).

``load_checkpoint`` verifies the size and SHA-256 before unpickling, and unpickles with
``weights_only=True`` (tensors, dicts, lists, numbers and strings only: a crafted file cannot run code).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

from .folder import Meta, begin, finish, newest_loadable, record_file, verify
from .space import clear_disk_full, require_free_space, state_bytes

__all__ = [
    "CHECKPOINT_KEYS",
    "FORMAT",
    "STATE_FILE",
    "load_checkpoint",
    "load_full",
    "load_latest_valid",
    "save_checkpoint",
]

FORMAT = "full"
CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "data", "train_state")
STATE_FILE = "state.pt"


def _write_state(state: dict[str, Any], path: Path) -> None:
    torch.save(state, path)


def save_checkpoint(
    root: str | Path,
    step: int,
    state: dict[str, Any],
    keep_last: int | None = None,
    writer: Callable[[dict[str, Any], Path], None] = _write_state,
) -> Path:
    """Write ``state`` (keys ``CHECKPOINT_KEYS``) as ``root/step_<step>`` atomically; prune to ``keep_last``.

    Call on one process only (rank 0). ``writer`` writes ``state.pt`` (a hook for tests). A disk
    without room for the state's tensor bytes is an ``InsufficientSpaceError`` before anything is
    written, and a write that runs out of space becomes one (``checkpoint.space``); the previous
    checkpoints stay as they were either way.
    """
    missing = [k for k in CHECKPOINT_KEYS if k not in state]
    if missing:
        raise ValueError(f"checkpoint state lacks keys {missing}; expected {CHECKPOINT_KEYS}")
    tmp, final = begin(root, step)
    nbytes = state_bytes(state)
    with clear_disk_full(tmp, final.parent, nbytes, f"checkpoint {final.name}"):
        require_free_space(final.parent, nbytes, f"checkpoint {final.name}")  # before writing anything
        writer(state, tmp / STATE_FILE)
        world_size = state["train_state"].get("world_size", 1)
        meta = Meta(FORMAT, step, world_size, {STATE_FILE: record_file(tmp / STATE_FILE)})
        return finish(tmp, final, meta, keep_last)


def load_checkpoint(path: str | Path, mmap: bool = True) -> dict[str, Any]:
    """Verify a checkpoint folder (or its ``state.pt``) against ``meta.json`` and read it into CPU memory
    (``mmap``: memory-mapped, each tensor read when it is used).

    Raises ``FileNotFoundError`` (no ``state.pt``) or ``ValueError`` (size or checksum mismatch, a file
    that does not unpickle with ``weights_only=True`` -- including one that would run code -- or
    missing keys), each naming the folder.
    """
    path = Path(path)
    folder = path.parent if path.name == STATE_FILE else path
    if not (folder / STATE_FILE).is_file():
        raise FileNotFoundError(f"{folder} is not a checkpoint folder (no {STATE_FILE})")
    verify(folder, FORMAT)
    try:
        state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # UnpicklingError (refused globals), RuntimeError/EOFError (bad zip), ...
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"checkpoint {folder}: {STATE_FILE} does not load safely: {first_line}") from e
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"checkpoint {folder} lacks keys {missing}")
    return state


def load_full(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load a full checkpoint into ``model`` (and ``optimizer``; None: the weights only), sharded or not.

    Returns the small state every format returns: ``scheduler``, ``train_state``, and ``data`` and
    ``rng`` as lists by saving rank.
    """
    # Memory-mapped only for a sharded model: its shards are copied out (the ranks share the file's
    # pages). Unsharded, the optimizer keeps the loaded moments themselves: from a mapping they would
    # keep all of it alive, the model's pages too (4 bytes per parameter above an uninterrupted run).
    full = load_checkpoint(path, mmap=_sharded(model))
    options = StateDictOptions(full_state_dict=True)
    if optimizer is None:
        set_model_state_dict(model, full["model"], options=options)
    else:
        _skip_the_initializing_step(model, optimizer, full["optimizer"])
        set_state_dict(
            model,
            optimizer,
            model_state_dict=full["model"],
            optim_state_dict=full["optimizer"],
            options=options,
        )
    train_state = full["train_state"]
    return {
        "scheduler": full["scheduler"],
        "train_state": train_state,
        "data": full["data"],
        "rng": train_state.get("rng"),
    }


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _skip_the_initializing_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]
) -> None:
    """``set_state_dict`` makes a fresh optimizer's state by a step on zero gradients (a gradient, the
    moments and AdamW's temporaries: 16 bytes per parameter beside the loading state, the resumed
    process's peak). A model without sharded (DTensor) parameters does not need it: a placeholder
    state per parameter (the saved state's keys) skips that step, and loading replaces every one
    (``set_state_dict`` refuses a checkpoint that lacks a parameter's state)."""
    states = saved.get("state") or {}
    if optimizer.state or not states or _sharded(model):
        return  # FSDP2 needs the sharded state as the template of each tensor's placement
    keys = list(next(iter(states.values())))
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {k: torch.empty(1) for k in keys}  # one dimension: set_state_dict wants it


def load_latest_valid(
    root: str | Path, start_fresh: bool = False, load: Callable[[Path], Any] = load_checkpoint
) -> tuple[Path, Any] | None:
    """The newest checkpoint under ``root`` that verifies and loads, as ``(folder, load(folder))``
    (``infir2.checkpoint.folder.newest_loadable``; ``load`` defaults to this format's reader)."""
    return newest_loadable(root, load, start_fresh)
