"""One training process per run folder: an advisory lock held for the run's whole life.

Two ``infir2 train`` on the same run folder would both run: one would delete the other's temporary
checkpoint folder and both would append to one ``metrics.jsonl``. ``run_lock(run_dir)`` takes an
exclusive ``fcntl.flock`` on ``<run_dir>/.lock`` without waiting and writes the holder's pid into
the file; a second process gets ``RunLockedError`` naming that pid. The kernel drops a flock when
its file is closed, so the lock is released on every exit (normal, exception, ``kill -9``) and is
never stale: a lock file left by a dead process is simply taken again. The file itself stays (never
delete a lock file: a process could hold a lock on the deleted copy while another takes a new one).

Under ``torchrun`` only rank 0 takes the lock (the other ranks of one run share the folder).
POSIX only (``fcntl``); on a filesystem without ``flock`` support (some network filesystems) the
lock is skipped with a warning.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["LOCK_FILE", "RunLockedError", "run_lock"]

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"


class RunLockedError(ValueError):
    """The run folder is locked by another live process (a ValueError: the CLI's one-line user error)."""


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


@contextmanager
def run_lock(run_dir: str | Path, enabled: bool = True) -> Iterator[Path | None]:
    """Hold the run folder's lock for the ``with`` block (creates the folder); yields the lock file."""
    if not enabled:
        yield None
        return
    import fcntl  # POSIX only; imported here so the module imports everywhere

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunLockedError(
                    f"run folder {run_dir} is in use by process {_holder(path)} (lock {path}); wait for it "
                    "to finish, stop it, or choose another run.name"
                ) from None
            log.warning("could not lock %s (%s); running without a run lock", path, e)
            yield None
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        os.close(fd)  # releases the flock
