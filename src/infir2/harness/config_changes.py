"""Resuming with a changed config: what changed, what is refused, and the saved ``config.yaml`` kept.

A run folder's ``config.yaml`` is the resolved config the run was started with. Rerunning the command
resumes from the newest checkpoint -- with whatever config the rerun passes. Some fields change what
the run *means*; each stage lists them (``train.config.MEANINGFUL``: a different ``train.max_steps``
silently stretches the WSD schedule and jumps the learning rate back up; ``rl.config.MEANINGFUL``).
Those differences are refused (``ConfigChangedError``, listing ``key: saved -> now``) unless
``run.accept_config_changes`` (``--accept-config-changes`` of ``infir2 train`` and ``infir2 rl``).
Others (logging, evaluation and save cadence, the device, ``load.*``) are logged. A key the saved config
has and today's has not (renamed or removed; no release has been made, so no old name is translated)
differs like any other: ``key: value -> <absent>``.
Whenever the config differs, the saved one is kept as ``config.<step>.yaml`` (``<step>``: the newest
checkpoint's) before the new one is written: nothing is silently overwritten.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from .config import StageConfig, config_to_dict, save_config

__all__ = ["ConfigChangedError", "config_changes", "reconcile_saved_config"]

log = logging.getLogger(__name__)

#: keys under the stages' meaningful prefixes that only observe the run (FP8 telemetry cadence) or change
#: its memory, not its numbers (how long the FP8 weight copies live: the same bytes either way)
HARMLESS = ("fp8.stats_every", "fp8.weight_cache")
CONFIG_FILE = "config.yaml"
_ABSENT = "<absent>"


class ConfigChangedError(ValueError):
    """Resuming with meaningful config changes (a ValueError: the CLI's one-line user error)."""


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix[:-1]: data}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if (
            isinstance(value, dict) and value and prefix.count(".") == 0
        ):  # sections only (from_config stays whole)
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _meaningful(key: str, meaningful: tuple[str, ...]) -> bool:
    if key in HARMLESS:
        return False
    return any(key.startswith(m) if m.endswith(".") else key == m for m in meaningful)


def config_changes(
    saved: dict[str, Any], now: dict[str, Any], meaningful_keys: tuple[str, ...]
) -> tuple[list[str], list[str]]:
    """``(meaningful, harmless)``: ``"key: saved -> now"`` for each differing key; ``meaningful_keys``:
    the stage's dotted keys and section prefixes (ending in ".") that change what a run computes.

    A key absent from the saved config (a field added since) counts as harmless.
    """
    old, new = _flatten(saved), _flatten(now)
    meaningful: list[str] = []
    harmless: list[str] = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if a == b:
            continue
        line = f"{key}: {a} -> {b}"
        (meaningful if _meaningful(key, meaningful_keys) and a != _ABSENT else harmless).append(line)
    return meaningful, harmless


def _newest_step(run_dir: Path) -> int | None:
    steps = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*") if p.name[5:].isdigit()]
    return max(steps) if steps else None


def _backup_name(run_dir: Path, step: int) -> Path:
    path, n = run_dir / f"config.{step}.yaml", 1
    while path.exists():
        path, n = run_dir / f"config.{step}.{n}.yaml", n + 1
    return path


def reconcile_saved_config(
    cfg: StageConfig, meaningful_keys: tuple[str, ...], write: bool, resumes_own: bool = True
) -> None:
    """Compare a stage's ``cfg`` with the run folder's saved config; refuse, log, keep the old one, write
    the new.

    Refuses only when the run resumes its own checkpoints (``step_*`` folders exist and ``resumes_own``:
    ``infir2 train --load`` starts elsewhere). Every rank may call it (read-only unless ``write``): all
    reach the same decision.
    """
    run_dir = cfg.run_dir
    path = run_dir / CONFIG_FILE
    now = config_to_dict(cfg)
    saved = None
    if path.is_file():
        try:
            saved = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: the run's saved config is not valid YAML ({e}); move it aside") from e
    step = _newest_step(run_dir)
    if isinstance(saved, dict):
        meaningful, harmless = config_changes(saved, now, meaningful_keys)
        resuming = step is not None and resumes_own
        if meaningful and resuming and not cfg.run.accept_config_changes:
            raise ConfigChangedError(
                f"{path}: resuming run {run_dir} with a different config changes its meaning: "
                + "; ".join(meaningful)
                + ". Rerun with the saved config, choose another run.name, or pass --accept-config-changes"
            )
        for line in meaningful:
            log.warning("config change accepted (run.accept_config_changes): %s", line)
        for line in harmless:
            log.info("config change: %s", line)
        if (meaningful or harmless) and write:
            backup = _backup_name(run_dir, step or 0)
            path.rename(backup)
            log.info("the run's previous config is kept as %s", backup)
    if write:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, path)
