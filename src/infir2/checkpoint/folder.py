"""Training checkpoints: one dict with fixed keys, written atomically, listed, loaded.

A checkpoint is a folder ``<run>/checkpoints/step_<8 digits>/`` (the number of optimizer steps done)
holding ``state.pt`` -- a ``torch.save`` of::

    {"model":       full (unsharded) model state dict, fp32 masters, nn.Linear keys,
     "optimizer":   full optimizer state dict keyed by parameter name (AdamW moments, fp32),
     "scheduler":   {"step": steps done} -- schedules are pure functions of the step,
     "data":        [StepSource.state_dict() of rank 0, rank 1, ...],
     "train_state": {"step", "tokens_seen", "nonfinite_total", "nonfinite_in_row", "world_size",
                     "rng": [per-rank RNG states], "config": resolved run config}}

and ``meta.json`` (step, world size, size and SHA-256 of ``state.pt``). Full state dicts (gathered
to rank 0 by ``torch.distributed.checkpoint.state_dict``) make a checkpoint independent of the
sharding: it loads on any number of ranks (the data position needs the same world size) and in a plain
single-process ``torch.load``. The cost is that rank 0 holds the whole state in CPU memory while
saving (about 12 bytes per parameter) -- fine up to a few billion parameters; beyond that use the
sharded format (``train.checkpoint_format: dcp``, ``infir2.train.sharded_checkpoint``), which keeps
this folder layout, ``meta.json`` checksums (``sha256_file`` / ``verify_file``) and ``load_latest_valid``.

Atomicity: everything is written into ``checkpoints/.tmp-step_.../``, each file is fsynced, then the
folder is renamed to its final name (``rename`` is atomic on POSIX) and the parent fsynced. A kill
at any moment leaves either the old set of checkpoints or the old set plus the new one; leftover
``.tmp-*`` folders are ignored and removed by the next save.

The Hugging Face folder at the end of a run is not written here: ``train.checkpointing.export_final``
calls ``export.export_model``, the code behind ``infir2 export``.

Damage: a disk, a copy or a hand can still damage a finished checkpoint (same-size garbage, random
bytes, a truncated file). ``load_checkpoint`` verifies the size and SHA-256 recorded in ``meta.json``
before unpickling, and unpickles with ``weights_only=True`` (tensors, dicts, lists, numbers and
strings only: a crafted file cannot run code). ``load_latest_valid`` walks the run's checkpoints from
the newest down, skips each one that fails with a WARNING naming it, and refuses
(``NoLoadableCheckpointError``) when there are ``step_*`` folders but none loads -- silently
starting again from step 0 would overwrite them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHECKPOINT_KEYS",
    "NoLoadableCheckpointError",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_valid",
    "save_checkpoint",
    "sha256_file",
    "verify_file",
]

log = logging.getLogger(__name__)

CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "data", "train_state")
_STEP_DIR = re.compile(r"^step_(\d{8})$")
STATE_FILE = "state.pt"
META_FILE = "meta.json"
DAMAGED_PREFIX = "damaged-"  # checkpoints set aside by load_latest_valid(start_fresh=True)
_HASH_CHUNK_BYTES = 8 << 20  # read size while hashing: large enough to run at disk speed


class NoLoadableCheckpointError(ValueError):
    """``step_*`` folders exist but none verifies and loads (a ValueError: the CLI's one-line user error)."""


def sha256_file(path: Path) -> str:
    """SHA-256 (hex) of a file, read in chunks: what ``meta.json`` records for every checkpoint file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


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
            "state_bytes": (tmp / STATE_FILE).stat().st_size, "state_sha256": sha256_file(tmp / STATE_FILE)}  # fmt: skip
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
    """Cheap completeness check (sizes only) used to list checkpoints; ``_verify`` is the full one."""
    try:
        meta = json.loads((path / META_FILE).read_text())
        return (path / STATE_FILE).stat().st_size == meta["state_bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def verify_file(folder: Path, name: str, expected_bytes: int, expected_sha: str | None) -> None:
    """Raise ValueError unless ``folder/name`` has the size and SHA-256 that ``meta.json`` records
    (``expected_sha`` None: written before checksums were recorded; loaded with a warning)."""
    try:
        size = (folder / name).stat().st_size
    except OSError as e:
        raise ValueError(f"checkpoint {folder}: {name} is missing ({e})") from e
    if size != expected_bytes:
        raise ValueError(f"checkpoint {folder}: {name} has {size} bytes, {META_FILE} records "
                         f"{expected_bytes} (truncated or incomplete)")  # fmt: skip
    if expected_sha is None:
        log.warning(
            "checkpoint %s has no checksum for %s in %s; loading it unverified", folder, name, META_FILE
        )
    elif sha256_file(folder / name) != expected_sha:
        raise ValueError(f"checkpoint {folder}: {name} does not match the SHA-256 in {META_FILE} (damaged)")


def _verify(folder: Path) -> None:
    """Raise ValueError unless ``state.pt`` has the size and SHA-256 that ``meta.json`` records."""
    try:
        meta = json.loads((folder / META_FILE).read_text())
        expected_bytes, expected_sha = meta["state_bytes"], meta.get("state_sha256")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint {folder}: unreadable {META_FILE} ({e})") from e
    verify_file(folder, STATE_FILE, expected_bytes, expected_sha)


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
    """Verify a checkpoint folder (or its ``state.pt``) against ``meta.json`` and read it into CPU memory.

    Raises ``FileNotFoundError`` (no ``state.pt``) or ``ValueError`` (size or checksum mismatch, a file
    that does not unpickle with ``weights_only=True`` -- including one that would run code -- or
    missing keys), each naming the folder.
    """
    path = Path(path)
    folder = path.parent if path.name == STATE_FILE else path
    if not (folder / STATE_FILE).is_file():
        raise FileNotFoundError(f"{folder} is not a checkpoint folder (no {STATE_FILE})")
    _verify(folder)
    try:
        state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # UnpicklingError (refused globals), RuntimeError/EOFError (bad zip), ...
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"checkpoint {folder}: {STATE_FILE} does not load safely: {first_line}") from e
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"checkpoint {folder} lacks keys {missing}")
    return state


def load_latest_valid(
    root: str | Path, start_fresh: bool = False, load: Callable[[Path], Any] = load_checkpoint
) -> tuple[Path, Any] | None:
    """The newest checkpoint under ``root`` that verifies and loads, as ``(folder, load(folder))``.

    ``load`` (default ``load_checkpoint``) verifies and reads one folder, raising ``OSError`` or
    ``ValueError`` when it cannot: the training loop passes one that also reads sharded checkpoints.

    Each ``step_*`` folder that fails is skipped with a WARNING naming it and the reason; ``None``
    when ``root`` holds no ``step_*`` folder. When some exist but none loads, raises
    ``NoLoadableCheckpointError`` -- unless ``start_fresh``, which renames them ``damaged-step_*``
    (kept for inspection, ignored from then on) and returns ``None``.
    """
    root = Path(root)
    folders = sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)),
                     key=lambda p: int(p.name[5:])) if root.is_dir() else []  # fmt: skip
    for folder in reversed(folders):
        try:
            return folder, load(folder)
        except (OSError, ValueError) as e:
            log.warning("skipping checkpoint %s: %s", folder, e)
    if not folders:
        return None
    if not start_fresh:
        raise NoLoadableCheckpointError(
            f"none of the {len(folders)} checkpoints in {root} loads (see the warnings above); refusing to "
            "start from step 0 over them. Restore them, or pass --start-fresh to set them aside and start again"
        )
    for folder in folders:
        with contextlib.suppress(OSError):  # another rank renamed it first
            folder.rename(folder.with_name(DAMAGED_PREFIX + folder.name))
    log.warning(
        "starting fresh: set aside %d damaged checkpoints in %s as %s*", len(folders), root, DAMAGED_PREFIX
    )
    return None
