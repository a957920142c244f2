"""Paths every layer reads or writes, checked once: a damaged weight file, an output folder.

``check_safetensors(folder)`` opens each ``*.safetensors`` header (a few KiB, no tensor is read): a
truncated file or a garbage header is a ``ValueError`` naming the file and what the safetensors reader
said, where it was a ``SafetensorError`` traceback. ``make_folder(path, what)`` creates an output folder
or says in one line why it cannot (a file in the way, no permission), where it was an ``OSError``
traceback. Imports nothing of infir2 (like ``_dist``, ``_logging``).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_safetensors", "make_folder"]


def check_safetensors(folder: str | Path) -> None:
    """Every ``*.safetensors`` of ``folder`` has a readable header covering the file, or ``ValueError``."""
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises its own SafetensorError (not a ValueError) or OSError
            raise ValueError(f"{path} is damaged ({e}): copy it again or point at another folder") from None


def make_folder(path: str | Path, what: str) -> Path:
    """``path`` created (parents too) and writable, or a ``ValueError`` naming ``what`` (the key or flag)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"{what}: {path} (or a folder above it) is a file, not a folder") from None
    except NotADirectoryError:
        raise ValueError(f"{what}: a folder above {path} is a file") from None
    except OSError as e:
        raise ValueError(f"{what}: cannot create {path}: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: {path} is not writable")
    return path
