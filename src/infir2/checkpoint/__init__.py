"""Training checkpoints: one folder per saved step, two formats inside it.

* ``folder.py`` -- the mechanics every format shares: the temporary folder, fsync, the atomic rename,
  the one ``meta.json`` layout (format, step, world size, a ``files`` map with sizes and SHA-256; an
  older one is refused, ``OlderLayoutError``), list, verify, prune, and the newest checkpoint that loads;
* ``full.py`` -- ``full``: the whole state in one ``state.pt``, gathered to rank 0;
* ``sharded.py`` -- ``dcp``: every rank writes its own shards (``torch.distributed.checkpoint``),
  resharded on load, optionally written in the background;
* ``space.py`` -- disk space: every save checks the room it needs before writing and turns a full
  disk into one ``InsufficientSpaceError`` line; ``check_room_for_saves`` is the check before a run.

Both load into a model and optimizer (``load_full``, ``load_sharded``; :func:`load_into` picks by
``meta.json``) and return the same small state: ``scheduler``, ``train_state``, and ``data`` and
``rng`` by saving rank. What to save, when, and how a run resumes is ``infir2.harness.resume``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .folder import (
    DAMAGED_PREFIX,
    META_FILE,
    NO_OLDER_LAYOUTS,
    NoLoadableCheckpointError,
    OlderLayoutError,
    latest_checkpoint,
    list_checkpoints,
    older_layout,
    read_meta,
    sha256_file,
    verify,
    verify_file,
)
from .full import CHECKPOINT_KEYS, STATE_FILE, load_checkpoint, load_full, load_latest_valid, save_checkpoint
from .sharded import (
    PendingSave,
    is_sharded_checkpoint,
    is_sharded_folder,
    iter_model_tensors,
    list_sharded,
    load_sharded,
    save_sharded,
    verify_sharded,
)
from .space import InsufficientSpaceError, check_room_for_saves, require_free_space, save_bytes

__all__ = [
    "CHECKPOINT_KEYS",
    "DAMAGED_PREFIX",
    "META_FILE",
    "NO_OLDER_LAYOUTS",
    "STATE_FILE",
    "InsufficientSpaceError",
    "NoLoadableCheckpointError",
    "OlderLayoutError",
    "PendingSave",
    "check_room_for_saves",
    "is_sharded_checkpoint",
    "is_sharded_folder",
    "iter_model_tensors",
    "latest_checkpoint",
    "list_checkpoints",
    "list_sharded",
    "load_checkpoint",
    "load_full",
    "load_into",
    "load_latest_valid",
    "load_sharded",
    "older_layout",
    "read_meta",
    "require_free_space",
    "save_bytes",
    "save_checkpoint",
    "save_sharded",
    "sha256_file",
    "verify",
    "verify_file",
    "verify_sharded",
]


def load_into(
    folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: Any
) -> dict[str, Any]:
    """Verify a checkpoint of either format and load it into ``model`` (and ``optimizer``; None: the
    weights only); returns the small state (module docstring). ``env``: the ``infir2._dist.DistEnv``."""
    if is_sharded_folder(folder):
        return load_sharded(folder, model, optimizer, env)
    return load_full(folder, model, optimizer)
