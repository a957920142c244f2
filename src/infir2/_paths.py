"""Paths every layer reads or writes, checked once: a damaged weight file, an output folder, a JSONL file.

``check_safetensors(folder)`` opens each ``*.safetensors`` header (a few KiB, no tensor is read): a
truncated file or a garbage header is a ``ValueError`` naming the file and what the safetensors reader
said, where it was a ``SafetensorError`` traceback. ``make_folder(path, what)`` creates an output folder
or says in one line why it cannot (a file in the way, no permission), where it was an ``OSError``
traceback; ``check_out_folder(path, what)`` checks the same without making anything (before any work).
``jsonl_records(path)`` reads a JSONL file line by line (CPT documents, SFT conversations, benchmark
problems): bytes that are not UTF-8 or a line that is not JSON is one ``ValueError`` naming
``file:line``. Imports nothing of infir2 (like ``_dist``, ``_logging``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["check_out_folder", "check_safetensors", "jsonl_records", "make_folder", "not_utf8"]


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


def check_out_folder(path: str | Path, what: str) -> None:
    """``path`` is a folder, or can be made one, and can be written: checked without making anything, so
    that a command refuses a bad output folder in one line naming ``what`` (its flag) before any work,
    not with an ``OSError`` traceback when its first file is written."""
    path = Path(path)
    top = next((p for p in (path, *path.parents) if p.exists() or p.is_symlink()), Path("."))
    if not top.is_dir():
        where = "" if top == path else f" ({top}, a folder above it)"
        raise ValueError(f"{what} {path}: is a file{where}, not a folder; choose another {what}")
    if not os.access(top, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path}: {top} is not writable (a read-only folder); choose another {what}")
    if top != path:  # access() is not the whole story (root on a read-only mount, sysfs): try, and undo
        first = top / path.relative_to(top).parts[0]  # the one folder made here, then removed
        try:
            first.mkdir()
        except OSError as e:
            raise ValueError(
                f"{what} {path}: cannot create {first}: {e.strerror}; choose another {what}"
            ) from None
        first.rmdir()


def jsonl_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Each non-blank line of the JSONL file ``path`` as ``(line number, its JSON value)``; bytes that are
    not UTF-8 or a line that is not JSON is a ``ValueError`` naming ``file:line``."""
    with Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: {not_utf8(e)}") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            yield lineno, value


def not_utf8(e: UnicodeDecodeError) -> str:
    """What a file's bytes that are not UTF-8 are, and the fix (after the caller's ``file:line:``)."""
    return f"not valid UTF-8 (byte 0x{e.object[e.start]:02x}); re-encode the file as UTF-8"
