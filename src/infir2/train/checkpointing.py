"""A run's persistence: save the full training state, resume or start from a checkpoint, export the model.

``save`` gathers model, optimizer, data positions and RNG states of every rank to rank 0 and writes
them with ``checkpoint.save_checkpoint`` (the format is documented there). ``restore`` picks the run
folder's latest checkpoint (auto-resume), else ``load.path``, and applies ``load.mode``:

* ``resume``       -- everything, exactly (the same number of processes is required);
* ``decay_only``   -- model + optimizer (the config's hyperparameters win), the step counter unless
  ``load.reset_step``, the data position unless ``load.reset_data``: a WSD decay from a stable checkpoint;
* ``weights_only`` -- the model only; a new run at step 0.

``export_final`` writes ``<run>/hf`` with ``export.export_model`` -- the code behind ``infir2 export``,
so the run's Hugging Face folder has the same layout and generation config (stop tokens) as an export.
It first removes ``<run>/.tmp-hf-*``: the partial folder of an export that was killed.
"""

from __future__ import annotations

import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from .. import checkpoint as ckpt
from ..data.base import StepSource
from ..export import export_model
from .config import RunConfig, config_to_dict
from .distributed import DistEnv, broadcast_object, gather_objects

__all__ = ["TrainState", "export_final", "restore", "save"]

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """The loop's own counters; saved under ``train_state`` in every checkpoint."""

    step: int = 0  # optimizer steps done (skipped ones included)
    tokens_seen: int = 0
    nonfinite_total: int = 0
    nonfinite_in_row: int = 0


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(cfg: RunConfig, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer, source: StepSource,
         state: TrainState) -> Path | None:  # fmt: skip
    """Gather the full state on rank 0 and write it atomically (all ranks must call)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    data_states = gather_objects(source.state_dict(), env)
    rng_states = gather_objects(_rng_state(), env)
    path = None
    if env.is_main:
        train_state = {
            **vars(state),
            "world_size": env.world_size,
            "rng": rng_states,
            "config": config_to_dict(cfg),
        }
        full = {"model": model_sd, "optimizer": optim_sd, "scheduler": {"step": state.step},
                "data": data_states, "train_state": train_state}  # fmt: skip
        path = ckpt.save_checkpoint(
            cfg.run_dir / "checkpoints", state.step, full, keep_last=cfg.train.keep_last
        )
    return broadcast_object(path, env)  # type: ignore[return-value]


def _apply_optim_config(optimizer: torch.optim.Optimizer, cfg: RunConfig) -> None:
    """After loading optimizer state, the config's hyperparameters win (a decay-only run may change them)."""
    for i, group in enumerate(optimizer.param_groups):
        group.update(
            betas=cfg.optim.betas, eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay if i == 0 else 0.0
        )


def restore(cfg: RunConfig, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer,
            source: StepSource) -> tuple[TrainState, Path | None]:  # fmt: skip
    """Resume from the run folder's latest checkpoint, else from ``load.path``; returns the counters."""
    # every rank verifies and maps the file (mmap: the page cache is shared); damaged ones are skipped
    forced = cfg.load.force and cfg.load.path
    own = None if forced else ckpt.load_latest_valid(cfg.run_dir / "checkpoints", cfg.load.start_fresh)
    if own is not None:
        (path, full), mode = own, "resume"
    elif cfg.load.path:
        path, mode = Path(cfg.load.path), cfg.load.mode
        full = ckpt.load_checkpoint(path)
    else:
        return TrainState(), None
    options = StateDictOptions(full_state_dict=True)
    model_sd = full["model"]
    if mode == "weights_only":
        set_model_state_dict(model, model_sd, options=options)
        log.info("loaded model weights from %s (fresh optimizer, step 0)", path)
        return TrainState(), path
    set_state_dict(
        model, optimizer, model_state_dict=model_sd, optim_state_dict=full["optimizer"], options=options
    )
    _apply_optim_config(optimizer, cfg)
    saved = full["train_state"]
    state = TrainState(**{k: saved[k] for k in vars(TrainState())})
    same_world = saved["world_size"] == env.world_size
    if mode == "resume":
        if not same_world:
            raise ValueError(f"checkpoint {path} was written by {saved['world_size']} processes; resuming it exactly "
                             f"needs the same number (got {env.world_size}); use load.mode=decay_only or weights_only")  # fmt: skip
        source.load_state_dict(full["data"][env.rank])
        _set_rng_state(saved["rng"][env.rank])
        log.info("resumed from %s at step %d", path, state.step)
        return state, path
    if not cfg.load.reset_data:
        if not same_world:
            raise ValueError(f"load.reset_data: checkpoint {path} has the data position of {saved['world_size']} "
                             f"processes, this run has {env.world_size}; set load.reset_data=true")  # fmt: skip
        source.load_state_dict(full["data"][env.rank])
    if cfg.load.reset_step:
        state = TrainState()
    state.nonfinite_in_row = 0
    log.info("decay-only start from %s: model + optimizer loaded, step %d, new schedule", path, state.step)
    return state, path


def export_final(cfg: RunConfig, env: DistEnv, model: nn.Module, tokenizer: Any) -> Path | None:
    """``<run>/hf``: the trained model as a Hugging Face folder (``model.export_dtype`` or ``precision``)."""
    model_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = None
    if env.is_main:
        for stale in cfg.run_dir.glob(".tmp-hf-*"):  # a killed export's partial folder (we hold the run lock)
            shutil.rmtree(stale, ignore_errors=True)
            log.info("removed %s, left by an interrupted export", stale)
        fmt = (
            cfg.model.export_dtype or cfg.model.precision
        )  # "fp32" | "bf16": export formats of the same name
        out = export_model(model, tokenizer, cfg.run_dir / "hf", fmt=fmt, state_dict=model_sd, overwrite=True)  # type: ignore[arg-type]
    return broadcast_object(out, env)  # type: ignore[return-value]
