"""The checkpoint folder, whatever the format inside: atomic write, ``meta.json``, list, verify, prune.

A checkpoint is a folder ``<run>/checkpoints/step_<8 digits>/`` (the number of optimizer steps done)
holding the files of its format (``full``: one ``state.pt``; ``dcp``: every rank's shards) and
``meta.json``, written last::

    {"format": "full" | "dcp", "step": 12, "world_size": 2,
     "files": {"<name>": {"bytes": 1234, "sha256": "<hex>"}, ...}}

Atomicity: everything is written into ``checkpoints/.tmp-step_.../`` (:func:`begin`), each file is
fsynced and hashed, then :func:`finish` writes ``meta.json``, fsyncs the folder and renames it to its
final name (``rename`` is atomic on POSIX) and fsyncs the parent. A kill at any moment leaves
either the old set of checkpoints or the old set plus the new one; leftover ``.tmp-*`` folders are
ignored and removed by the next save.

Damage: a disk, a copy or a hand can still damage a finished checkpoint (same-size garbage, random
bytes, a truncated file). :func:`verify` checks every file's size and SHA-256 against ``meta.json``
before a format reads it; ``load_latest_valid`` walks the run's checkpoints from the newest down,
skips each one that fails with a WARNING naming it (:func:`newest_loadable`), and refuses (``NoLoadableCheckpointError``) when
there are ``step_*`` folders but none loads -- silently starting again from step 0 would overwrite
them.

Older layouts: a ``meta.json`` with its ``step`` (every layout had one; without it, it is damaged) that
lacks another key of the layout above (``format``, ``files``, a file's ``sha256``: the ``state_bytes`` /
``state_sha256`` layout before the ``files`` map, a file recorded without a checksum) was written by a
version no release has been made of. It is refused with an
``OlderLayoutError`` naming the folder (:func:`read_meta`; CONTRIBUTING.md, "Layouts no release has
written"), and :func:`newest_loadable` stops there instead of skipping it: it is not damaged, and
``start_fresh`` does not set it aside as if it were.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DAMAGED_PREFIX",
    "META_FILE",
    "NO_OLDER_LAYOUTS",
    "FileRecord",
    "Meta",
    "NoLoadableCheckpointError",
    "OlderLayoutError",
    "begin",
    "finish",
    "fsync",
    "is_complete",
    "latest_checkpoint",
    "list_checkpoints",
    "newest_loadable",
    "older_layout",
    "read_meta",
    "record_file",
    "sha256_file",
    "verify",
    "verify_file",
]

log = logging.getLogger("infir2.checkpoint")

_STEP_DIR = re.compile(r"^step_(\d{8})$")
META_FILE = "meta.json"
DAMAGED_PREFIX = "damaged-"  # checkpoints set aside by load_latest_valid(start_fresh=True)
_HASH_CHUNK_BYTES = 8 << 20  # read size while hashing: large enough to run at disk speed
_META_KEYS = ("format", "step", "world_size", "files")
#: what a refusal of a checkpoint of an older layout (its ``meta.json`` here, its small state in
#: ``harness.resume``) tells the user after naming the folder and what differs
NO_OLDER_LAYOUTS = (
    "a layout this version does not read (no release of infir2 has been made, so none older is): "
    "start afresh under another run.name, or move the checkpoint aside"
)


class NoLoadableCheckpointError(ValueError):
    """``step_*`` folders exist but none verifies and loads (a ValueError: the CLI's one-line user error)."""


class OlderLayoutError(ValueError):
    """A checkpoint of a layout this version does not read (:func:`older_layout`): not damaged, so
    :func:`newest_loadable` stops at it rather than skipping it or setting it aside."""


def older_layout(folder: str | Path, problem: str) -> OlderLayoutError:
    """The one-line refusal of checkpoint ``folder``, whose layout differs as ``problem`` says."""
    return OlderLayoutError(f"checkpoint {folder}: {problem}: {NO_OLDER_LAYOUTS}")


@dataclass(frozen=True)
class FileRecord:
    """What ``meta.json`` records of one file."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class Meta:
    """A checkpoint's ``meta.json``."""

    format: str
    step: int
    world_size: int
    files: dict[str, FileRecord]


def sha256_file(path: Path) -> str:
    """SHA-256 (hex) of a file, read in chunks: what ``meta.json`` records for every checkpoint file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def fsync(path: Path) -> None:
    """Flush a file or a folder (its entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def record_file(path: Path) -> FileRecord:
    """fsync a written file and record its size and SHA-256."""
    fsync(path)
    return FileRecord(path.stat().st_size, sha256_file(path))


def begin(root: str | Path, step: int) -> tuple[Path, Path]:
    """Make the temporary folder of checkpoint ``step`` under ``root`` (removing a killed save's):
    returns ``(tmp, final)``. Call on one process (rank 0)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}"
    tmp.mkdir()
    return tmp, final


def finish(tmp: Path, final: Path, meta: Meta, keep_last: int | None = None) -> Path:
    """Write ``meta.json`` into ``tmp``, rename it to ``final`` (replacing a checkpoint of the same step)
    and keep the newest ``keep_last`` checkpoints. Call on one process, after every file is recorded."""
    files = {name: {"bytes": r.bytes, "sha256": r.sha256} for name, r in sorted(meta.files.items())}
    data = {"format": meta.format, "step": meta.step, "world_size": meta.world_size, "files": files}
    (tmp / META_FILE).write_text(json.dumps(data, indent=1))
    fsync(tmp / META_FILE)
    fsync(tmp)
    root = final.parent
    if final.exists():  # the same step saved again (e.g. the end of a resumed run): replace it
        old = root / f".tmp-old-{final.name}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync(root)
    if keep_last:
        for old_ckpt in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old_ckpt, ignore_errors=True)
    return final


def read_meta(folder: str | Path) -> Meta:
    """A checkpoint's ``meta.json``; ``OlderLayoutError`` when it lacks a key of the one layout (module
    docstring), ValueError naming the folder when it is missing or malformed."""
    folder = Path(folder)
    try:
        data = json.loads((folder / META_FILE).read_text())
        _check_meta_layout(folder, data)
        files = {name: FileRecord(int(r["bytes"]), str(r["sha256"])) for name, r in data["files"].items()}
        return Meta(str(data["format"]), int(data["step"]), int(data["world_size"]), files)
    except OlderLayoutError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"checkpoint {folder}: unreadable {META_FILE} ({type(e).__name__}: {e})") from e


def _check_meta_layout(folder: Path, data: Any) -> None:
    """Refuse a ``meta.json`` of an older layout: a checkpoint's (a mapping with its ``step``, which
    every layout recorded) without another key of this one, or a file of its ``files`` map without a
    ``sha256``. Anything else malformed is damage, left to ``read_meta``'s own error."""
    if not isinstance(data, dict) or "step" not in data:
        return
    missing = [k for k in _META_KEYS if k not in data]
    if missing:
        raise older_layout(
            folder, f"{META_FILE} has no {', '.join(missing)} (it holds {', '.join(sorted(data))})"
        )
    files = data["files"] if isinstance(data["files"], dict) else {}
    for name, record in sorted(files.items()):
        if isinstance(record, dict) and record.get("sha256") is None:
            raise older_layout(folder, f"{META_FILE} records no sha256 for {name}")


def is_complete(folder: str | Path, fmt: str | None = None) -> bool:
    """Cheap completeness check (sizes only, used for listing): every file ``meta.json`` records is
    there with its size (and the format is ``fmt`` when given). :func:`verify` is the full check."""
    folder = Path(folder)
    try:
        meta = read_meta(folder)
        return (fmt is None or meta.format == fmt) and all(
            (folder / name).stat().st_size == r.bytes for name, r in meta.files.items()
        )
    except (OSError, ValueError):
        return False


def verify_file(folder: Path, name: str, expected_bytes: int, expected_sha: str) -> None:
    """Raise ValueError unless ``folder/name`` has the size and SHA-256 that ``meta.json`` records."""
    try:
        size = (folder / name).stat().st_size
    except OSError as e:
        raise ValueError(f"checkpoint {folder}: {name} is missing ({e})") from e
    if size != expected_bytes:
        raise ValueError(
            f"checkpoint {folder}: {name} has {size} bytes, {META_FILE} records "
            f"{expected_bytes} (truncated or incomplete)"
        )
    if sha256_file(folder / name) != expected_sha:
        raise ValueError(f"checkpoint {folder}: {name} does not match the SHA-256 in {META_FILE} (damaged)")


def verify(folder: str | Path, fmt: str | None = None) -> Meta:
    """Raise ValueError unless every file has the size and SHA-256 of ``meta.json`` (and the folder is
    of format ``fmt`` when given); returns the meta."""
    folder = Path(folder)
    meta = read_meta(folder)
    if fmt is not None and meta.format != fmt:
        raise ValueError(f"checkpoint {folder}: {META_FILE} says format {meta.format!r}, expected {fmt!r}")
    for name, record in meta.files.items():
        verify_file(folder, name, record.bytes, record.sha256)
    return meta


def _step_folders(root: Path) -> list[Path]:
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name[5:]))


def list_checkpoints(root: str | Path, fmt: str | None = None) -> list[Path]:
    """Complete checkpoint folders under ``root`` (of format ``fmt``, default any), oldest first."""
    return [p for p in _step_folders(Path(root)) if is_complete(p, fmt)]


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def newest_loadable(
    root: str | Path, load: Callable[[Path], Any], start_fresh: bool = False
) -> tuple[Path, Any] | None:
    """The newest checkpoint under ``root`` that verifies and loads, as ``(folder, load(folder))``.

    ``load`` verifies and reads one folder, raising ``OSError`` or ``ValueError`` when it cannot (the
    full format's ``load_checkpoint``; the training loop passes one that reads either format into
    its model).

    Each ``step_*`` folder that fails is skipped with a WARNING naming it and the reason; ``None``
    when ``root`` holds no ``step_*`` folder. When some exist but none loads, raises
    ``NoLoadableCheckpointError`` -- unless ``start_fresh``, which renames them ``damaged-step_*``
    (kept for inspection, ignored from then on) and returns ``None``. A folder of an older layout
    (``OlderLayoutError``, start_fresh or not) stops the walk: it is not damaged, so skipping it would
    resume from an older state and ``start_fresh`` would call it damaged.
    """
    root = Path(root)
    folders = _step_folders(root)
    for folder in reversed(folders):
        try:
            return folder, load(folder)
        except OlderLayoutError:
            raise
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
