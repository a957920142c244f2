"""Worker processes of the demo's side-by-side runs: they end when the demo process does.

``ProcessPoolExecutor`` workers outlive a parent that is killed (SIGTERM, SIGKILL, a closed terminal):
they would go on training and writing into the output folder of a demo that no longer exists, and a
rerun into the same folder would clear it under them. ``die_with_parent`` (the pool's ``initializer``)
asks Linux to send the worker SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere it
does nothing and the old behaviour remains. ``start_worker`` sets up a worker for its next run.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

__all__ = ["die_with_parent", "start_worker"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Be sent SIGTERM when process ``parent_pid`` (the one that started this worker) dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return  # not permitted here: keep running, as without it
    if os.getppid() != parent_pid:  # the parent died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def start_worker(threads: int, label: str) -> None:
    """Set a worker up for one run: ``threads`` intra-op threads and log lines tagged ``[label]`` (a
    reused worker process logs under its new run)."""
    import torch

    torch.set_num_threads(threads)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [{label}] %(message)s", datefmt="%H:%M:%S", force=True
    )
