"""File permissions for what export writes (the one caller: ``export.shards``).

``safetensors.torch.save_file`` (and so ``save_pretrained``) creates its files with mode ``0600``,
while everything else we write gets the usual ``0666 & ~umask`` (``0644`` under the common umask
022): a model folder whose weights only their owner can read breaks serving it from another account.
``default_permissions`` gives a written file the mode a plain ``open(path, "w")`` would have.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_permissions"]

_CREATE_MODE = 0o666  # what open() asks for; the umask takes bits away


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it is to set it...
    os.umask(mask)  # ...and put it back at once
    return mask


def default_permissions(path: str | Path) -> None:
    """chmod ``path`` to ``0666 & ~umask``: the mode a file created with ``open`` would have."""
    os.chmod(path, _CREATE_MODE & ~_umask())
