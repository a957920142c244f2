"""One logging helper shared by every layer: log a message once per process."""

from __future__ import annotations

import logging

__all__ = ["log_once"]

_seen: set[tuple[str, str]] = set()


def log_once(logger: logging.Logger, message: str, level: int = logging.INFO) -> None:
    """Log ``message`` on ``logger`` the first time it is seen in this process, then never again."""
    key = (logger.name, message)
    if key not in _seen:
        _seen.add(key)
        logger.log(level, message)
