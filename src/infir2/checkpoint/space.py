"""Disk space for checkpoints: check the room a save needs before writing, and make a full disk one clear line.

A full checkpoint is 12 bytes per parameter (fp32 masters + two fp32 AdamW moments: 84 GB at 7B), and
a run keeps ``keep_last`` of them while it writes the next. When the disk fills up in the middle of a
write, torch's zip writer fails with ``RuntimeError: [enforce fail at inline_container.cc] ...
unexpected pos`` and DCP with a per-rank ``CheckpointException``: nothing says "disk full". So:

* every save first compares the bytes it will write (:func:`state_bytes` of the state it is handed)
  with the free space of the checkpoint folder's disk (:func:`require_free_space`) and refuses with an
  :class:`InsufficientSpaceError` naming the folder and both byte counts before it writes anything;
* a write that fails anyway (another process filled the disk meanwhile) runs inside
  :func:`clear_disk_full`: the partial ``.tmp-*`` folder is removed, and when the error is ``ENOSPC``
  or the disk now has less room than the save needs, it becomes the same one-line error;
* :func:`check_room_for_saves` is the check before a run starts: the first save's size is known from
  the model and the optimizer (:func:`save_bytes`), so a run that cannot save refuses at step 0, and a
  disk without room for ``keep_last`` + 1 checkpoints (the kept ones and the one being written) is a
  warning.

The previous checkpoints are never touched by a failed save: every format writes into its own
temporary folder and renames it into place only when it is complete (``checkpoint.folder``).
``InsufficientSpaceError`` is a ``ValueError``: the CLI prints it as one line and exits with status 2.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from .folder import list_checkpoints

__all__ = [
    "InsufficientSpaceError",
    "check_room_for_saves",
    "clear_disk_full",
    "free_bytes",
    "require_free_space",
    "save_bytes",
    "state_bytes",
]

log = logging.getLogger("infir2.checkpoint")

#: what a write that ran out of space raises: the OS, torch's zip writer, DCP (a BaseException)
_WRITE_ERRORS = (OSError, RuntimeError, CheckpointException)
#: room asked for beyond the tensor bytes: pickle / DCP metadata, meta.json, the filesystem's blocks
MARGIN_BYTES = 1 << 20
MARGIN_FRACTION = 0.02


class InsufficientSpaceError(ValueError):
    """The disk of a checkpoint folder lacks the room for a save (a ValueError: the CLI's one-line error)."""


def _existing(folder: Path) -> Path:
    """``folder`` or its nearest existing parent (a run folder may not exist before the first save)."""
    folder = folder.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def free_bytes(folder: str | Path) -> int:
    """Bytes free on the disk that holds (or will hold) ``folder``."""
    return int(shutil.disk_usage(_existing(Path(folder))).free)


def _needed(nbytes: int) -> int:
    return int(nbytes * (1 + MARGIN_FRACTION)) + MARGIN_BYTES


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _message(folder: Path, what: str, needed: int, free: int) -> str:
    return (
        f"not enough disk space in {folder}: {what} needs {_gb(needed)} ({needed} bytes), the disk has "
        f"{_gb(free)} ({free} bytes) free; free some space, or keep fewer checkpoints (train.keep_last)"
    )


def require_free_space(folder: str | Path, nbytes: int, what: str = "the checkpoint") -> None:
    """Raise :class:`InsufficientSpaceError` unless ``folder``'s disk has room for ``nbytes`` (plus a
    small margin for metadata)."""
    folder = Path(folder)
    needed, free = _needed(nbytes), free_bytes(folder)
    if free < needed:
        raise InsufficientSpaceError(_message(folder, what, needed, free))


@contextlib.contextmanager
def clear_disk_full(
    tmp: Path | None, folder: Path, nbytes: int, what: str = "the checkpoint"
) -> Iterator[None]:
    """Run a save's write; when it fails remove its partial folder ``tmp``, and turn a full disk
    (``ENOSPC``, or less room left than the save needs: torch's zip writer reports no errno) into an
    :class:`InsufficientSpaceError`; other errors pass unchanged."""
    try:
        yield
    except (Exception, CheckpointException) as e:  # not KeyboardInterrupt: a killed save's folder stays
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, _WRITE_ERRORS):
            raise
        needed, free = _needed(nbytes), free_bytes(folder)
        if getattr(e, "errno", None) == errno.ENOSPC or free < needed:
            raise InsufficientSpaceError(
                _message(folder, what, needed, free) + f" (the write failed: {_first_line(e)})"
            ) from e
        raise


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:160]


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # a DTensor's numel is the global one: every rank's shards


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict, each storage once: what a save writes (DTensors
    at their global size, i.e. every rank's shards together)."""
    seen: set[int] = set()
    total = 0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            key = id(item) if hasattr(item, "device_mesh") else item.untyped_storage().data_ptr() or id(item)
            if key not in seen:
                seen.add(key)
                total += _tensor_bytes(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def _moment_bytes(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> int:
    """An optimizer's state for ``p``: what it holds, or AdamW's before the first step (two moments in
    the optimizer's storage -- ``state_bytes`` -- or ``p``'s dtype, and the fp32 step counter)."""
    state = optimizer.state.get(p)
    if state:
        return state_bytes(state)
    if hasattr(optimizer, "state_bytes"):  # infir2's AdamWs: their storage (bf16, FP8 codes and scales)
        return int(optimizer.state_bytes(p))
    return 2 * p.numel() * p.element_size() + 4


def save_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """The bytes a checkpoint of ``model`` (each parameter once: tied ones are stored once) and
    ``optimizer`` writes, known before the first save."""
    params = list(model.parameters())  # tied parameters once
    buffers = [b for name, b in model.named_buffers() if _persistent(model, name)]
    total = sum(_tensor_bytes(t) for t in params + buffers)
    if optimizer is not None:
        total += sum(_moment_bytes(optimizer, p) for group in optimizer.param_groups for p in group["params"])
    return total


def _persistent(model: nn.Module, name: str) -> bool:
    module_name, _, buffer = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return buffer not in module._non_persistent_buffers_set


def check_room_for_saves(
    run_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, keep_last: int | None
) -> int:
    """Before a run starts: raise :class:`InsufficientSpaceError` when ``<run_dir>/checkpoints`` has no
    room for the first save; warn when it lacks room for the steady state (``keep_last`` checkpoints
    kept while the next is written; checkpoints already there count). Returns one save's bytes."""
    root = Path(run_dir) / "checkpoints"
    one = save_bytes(model, optimizer)
    require_free_space(root, one, "the first checkpoint")
    if keep_last:
        more = max(keep_last + 1 - len(list_checkpoints(root)), 1)
        needed, free = more * _needed(one), free_bytes(root)
        if free < needed:
            log.warning(
                "%s has room for the next checkpoint but not for %d more (train.keep_last=%d, %s each): "
                "a later save will fail unless space is freed",
                root,
                more,
                keep_last,
                _gb(one),
            )
    return one
