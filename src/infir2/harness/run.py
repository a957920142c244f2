"""One run of any stage, from process group to run folder: ``open_run`` and the shared command-line
arguments.

``open_run(run_dir, device, check)`` joins the torchrun process group (or none, for one process), runs
``check(env)`` (the stage's look at its inputs, before any folder exists), takes the run folder's lock
(rank 0; one process group per folder) and, when the run fails before it started (no step logged, no
checkpoint), removes the folder it created: a refused input leaves nothing behind.
``add_run_arguments`` / ``run_overrides``: the flags ``infir2 train`` and ``infir2 rl`` share (``--set``,
``--accept-config-changes``, ``--no-progress``), as config overrides.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .._paths import make_folder
from .distributed import DistEnv, init_distributed
from .lock import run_lock

__all__ = ["add_run_arguments", "add_set_argument", "log_outputs", "open_run", "run_overrides"]

log = logging.getLogger(__name__)


@contextmanager
def open_run(run_dir: Path, device: str, check: Callable[[DistEnv], None] | None = None) -> Iterator[DistEnv]:
    """The process group and the locked run folder of one run (every rank enters; module doc)."""
    env = init_distributed(device)
    created = env.is_main and not run_dir.exists()
    new_parents = [p for p in run_dir.parents if not p.exists()] if created else []  # nearest first
    try:
        if check is not None:
            check(env)
        if env.is_main:
            make_folder(run_dir, "run.out_dir / run.name")
        with run_lock(run_dir, enabled=env.is_main):
            yield env
    except Exception:
        if created and _remove_if_unstarted(run_dir):
            for parent in new_parents:  # run.out_dir too, if this call made it and it is empty
                with contextlib.suppress(OSError):
                    parent.rmdir()
        raise
    finally:
        env.close()


def _remove_if_unstarted(run_dir: Path) -> bool:
    """A run folder this call created, whose start failed (no step logged, no checkpoint): remove it.
    True if it is gone."""
    metrics = run_dir / "metrics.jsonl"
    if not run_dir.exists():
        return True
    if any((run_dir / "checkpoints").glob("step_*")) or (metrics.exists() and metrics.stat().st_size):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    log.info("removed %s: the run did not start", run_dir)
    return True


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE`` (repeatable): config overrides, typed by the field (``args.overrides``)."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set optim.lr=3e-4 (repeatable)",
    )


def add_run_arguments(parser: argparse.ArgumentParser, meaningful: str) -> None:
    """``--set``, ``--accept-config-changes`` and ``--no-progress``; ``meaningful``: the sections whose
    change a resume refuses, for the help text."""
    add_set_argument(parser)
    parser.add_argument(
        "--accept-config-changes",
        action="store_true",
        help=f"resume although fields that change the run's meaning ({meaningful}) differ from the run's "
        "config.yaml (sets run.accept_config_changes); the old one is kept as config.<step>.yaml",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (log lines instead)")


def run_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides of ``args`` plus those of the shared flags."""
    return list(args.overrides) + (["run.accept_config_changes=true"] if args.accept_config_changes else [])


def log_outputs(result: Any) -> None:
    """The line a finished run ends with: its folder, last checkpoint and Hugging Face export."""
    log.info(
        "run folder %s; checkpoint %s; Hugging Face export %s",
        result.run_dir,
        result.checkpoint,
        result.hf_dir,
    )
