"""Training checkpoints: one dict with fixed keys, written atomically, listed, loaded.

A checkpoint is a folder ``<run>/checkpoints/step_<8 digits>/`` (the number of optimizer steps done)
holding ``state.pt`` -- a ``torch.save`` of::

    {"model":       full (unsharded) model state dict, fp32 masters, nn.Linear keys,
     "optimizer":   full optimizer state dict keyed by parameter name (AdamW moments, fp32),
     "scheduler":   {"step": steps done} -- schedules are pure functions of the step,
     "data":        [StepSource.state_dict() of rank 0, rank 1, ...],
     "train_state": {"step", "tokens_seen", "nonfinite_total", "nonfinite_in_row", "world_size",
                     "rng": [per-rank RNG states], "config": resolved run config}}

and ``meta.json`` (step, world size, size of ``state.pt``). Full state dicts (gathered to rank 0
by ``torch.distributed.checkpoint.state_dict``) make a checkpoint independent of the sharding: it
loads on any number of ranks (the data position needs the same world size) and in a plain
single-process ``torch.load``. The cost is that rank 0 holds the whole state in CPU memory while
saving (about 12 bytes per parameter) -- fine up to a few billion parameters; beyond that a
sharded format would be the next step.

Atomicity: everything is written into ``checkpoints/.tmp-step_.../``, each file is fsynced, then the
folder is renamed to its final name (``rename`` is atomic on POSIX) and the parent fsynced. A kill
at any moment leaves either the old set of checkpoints or the old set plus the new one; leftover
``.tmp-*`` folders are ignored and removed by the next save.

The Hugging Face folder at the end of a run is not written here: ``train.checkpointing.export_final``
calls ``export.export_model``, the code behind ``infir2 export``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHECKPOINT_KEYS",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]

CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "data", "train_state")
_STEP_DIR = re.compile(r"^step_(\d{8})$")
STATE_FILE = "state.pt"
META_FILE = "meta.json"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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

    Call on one process only (rank 0). ``writer`` writes ``state.pt`` (a hook for tests).
    """
    missing = [k for k in CHECKPOINT_KEYS if k not in state]
    if missing:
        raise ValueError(f"checkpoint state lacks keys {missing}; expected {CHECKPOINT_KEYS}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    writer(state, tmp / STATE_FILE)
    _fsync_file(tmp / STATE_FILE)
    meta = {"step": step, "world_size": state["train_state"].get("world_size", 1),
            "state_bytes": (tmp / STATE_FILE).stat().st_size}  # fmt: skip
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
    _fsync_file(tmp / META_FILE)
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (e.g. the end of a resumed run): replace it
        old = root / f".tmp-old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    if keep_last:
        for old_ckpt in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old_ckpt, ignore_errors=True)
    return final


def _is_valid(path: Path) -> bool:
    try:
        meta = json.loads((path / META_FILE).read_text())
        return (path / STATE_FILE).stat().st_size == meta["state_bytes"]
    except (OSError, ValueError, KeyError):
        return False


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and _is_valid(p)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint folder (or its ``state.pt``) into CPU memory. Checkpoints are trusted files."""
    path = Path(path)
    folder = path.parent if path.name == STATE_FILE else path
    if not (folder / STATE_FILE).is_file():
        raise FileNotFoundError(f"{folder} is not a checkpoint folder (no {STATE_FILE})")
    if not _is_valid(folder):
        raise ValueError(
            f"checkpoint {folder} is incomplete or corrupt ({META_FILE} does not match {STATE_FILE})"
        )
    state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False, mmap=True)
    missing = [k for k in CHECKPOINT_KEYS if k not in state]
    if missing:
        raise ValueError(f"checkpoint {folder} lacks keys {missing}")
    return state
