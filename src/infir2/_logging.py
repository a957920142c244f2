"""Logging helpers shared by every layer: log a message once per process; the CLI's handler set-up."""

from __future__ import annotations

import logging

__all__ = ["FORMAT", "log_once", "setup_logging"]

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DATE_FORMAT = "%H:%M:%S"

_seen: set[tuple[str, str]] = set()
#: libraries that log at INFO on every call (``httpx2``: one "HTTP Request: ..." line per request)
_CHATTY = ("httpx", "httpx2")


def log_once(logger: logging.Logger, message: str, level: int = logging.INFO) -> None:
    """Log ``message`` on ``logger`` the first time it is seen in this process, then never again."""
    key = (logger.name, message)
    if key not in _seen:
        _seen.add(key)
        logger.log(level, message)


class _WarningsAndAbove(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def setup_logging(level: int, rank: int = 0, world_size: int = 1) -> None:
    """The root logger's handler for a CLI process (``rank`` of ``world_size``, as torchrun says).

    One process: every record at ``level`` and above, ``FORMAT``. Under torchrun every line says its
    rank (``[rank 1]``), INFO and DEBUG come from rank 0 only (the ranks log the same "converted",
    "done", "run folder" lines), warnings and errors from every rank: they can differ by rank.
    """
    fmt = FORMAT if world_size <= 1 else FORMAT.replace("%(levelname)s", f"[rank {rank}] %(levelname)s")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(fmt, datefmt=_DATE_FORMAT))
    if world_size > 1 and rank != 0:
        handler.addFilter(_WarningsAndAbove())
    logging.basicConfig(level=level, handlers=[handler])
    if level > logging.DEBUG:  # the HTTP client's INFO line per request (the server engine): debug only
        for name in _CHATTY:
            logging.getLogger(name).setLevel(logging.WARNING)
