"""A run's persistence: save the training state, resume or start from a checkpoint, export the model.

Two formats (``train.checkpoint_format``), the same ``step_<8 digits>`` folders with a checksummed
``meta.json``:

* ``full`` (default) -- ``save`` gathers model, optimizer, data positions and RNG states of every rank
  to rank 0 and writes them with ``checkpoint.save_checkpoint`` (one ``state.pt``, ``checkpoint/full.py``);
* ``dcp`` -- every rank writes its own shards (``checkpoint.save_sharded``, ``checkpoint/sharded.py``),
  nobody gathers the model; with ``train.async_save`` the write runs in the background and ``save``
  returns before the disk is done. Either way ``save`` returns a ``PendingSave``: the loop waits on it
  before the next save and at the end of the run.

``restore`` picks the run folder's newest checkpoint that verifies (``checkpoint.load_latest_valid``:
damaged ones are skipped with a warning; none loading is an error unless ``load.start_fresh``), of
either format, else ``load.path``, and applies ``load.mode``:

* ``resume``       -- everything; exactly (RNG states too) on the same number of processes. On another
  number (a sharded checkpoint reshards, a full one is resharded on load) model and optimizer are
  exact and the data continues at the same global sample count (:func:`data_state_for`);
  each rank's RNG is then seeded afresh (``run.seed + rank``);
* ``decay_only``   -- model + optimizer (the config's hyperparameters win), the step counter unless
  ``load.reset_step``, the data position unless ``load.reset_data``: a WSD decay from a stable checkpoint;
* ``weights_only`` -- the model only; a new run at step 0.

``export_final`` writes ``<run>/hf`` with ``export.export_model`` -- the code behind ``infir2 export``,
so the run's Hugging Face folder has the same layout and generation config (stop tokens) as an export.
It first removes ``<run>/.tmp-hf-*``: the partial folder of an export that was killed.
From a ``dcp`` run it streams the final sharded checkpoint into the writer one tensor at a time
(``iter_model_tensors``): rank 0 never holds the whole model.
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

from .. import checkpoint as ckpt
from ..checkpoint import PendingSave, is_sharded_folder, iter_model_tensors, save_sharded
from ..data.base import StepSource
from ..export import export_model
from .config import RunConfig, config_to_dict
from .distributed import DistEnv, broadcast_object, gather_objects

__all__ = ["PendingSave", "TrainState", "data_state_for", "export_final", "restore", "save"]

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


def save(
    cfg: RunConfig,
    env: DistEnv,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    source: StepSource,
    state: TrainState,
) -> PendingSave:
    """Write a checkpoint of ``train.checkpoint_format`` atomically (all ranks call; all wait on the result)."""
    if cfg.train.checkpoint_format == "dcp":
        extra = {
            "scheduler": {"step": state.step},
            "train_state": {**vars(state), "config": config_to_dict(cfg)},
            "data": source.state_dict(),
            "rng": _rng_state(),
        }
        return save_sharded(
            cfg.run_dir / "checkpoints",
            state.step,
            model,
            optimizer,
            extra,
            env,
            keep_last=cfg.train.keep_last,
            async_save=cfg.train.async_save,
        )
    written = _save_full(cfg, env, model, optimizer, source, state)
    return PendingSave(None, lambda: written)


def _save_full(
    cfg: RunConfig,
    env: DistEnv,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    source: StepSource,
    state: TrainState,
) -> Path:
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
        full = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": {"step": state.step},
            "data": data_states,
            "train_state": train_state,
        }
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


def _loader(env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer, weights_only: bool) -> Any:
    """``folder -> small state``: verify a checkpoint of either format, load it into model (and optimizer).

    The small state is ``{"scheduler", "train_state", "data": [per rank], "rng": [per rank]}``; a damaged
    checkpoint raises ``ValueError`` before anything is loaded (``load_latest_valid`` then tries the
    next older one).
    """

    def load(folder: Path) -> dict[str, Any]:
        return ckpt.load_into(folder, model, None if weights_only else optimizer, env)

    return load


def data_state_for(loaded: dict[str, Any], env: DistEnv) -> Any:
    """This rank's data-source state from a checkpoint's small state.

    The sources' states (``CptSource``, ``SftSource``) are positions in the *global* sample order
    (epoch, step in epoch, global batch size), the same on every rank. On the same world size each
    rank gets its own state back; on another world size they are valid too when all ranks saved the
    same state: the run continues at the same global sample count (step x global batch size), each
    rank now reading its new share of every global batch. A source whose per-rank states differ
    cannot be resumed on another world size (a ``ValueError`` says so).
    """
    states, saved_world = loaded["data"], loaded["train_state"]["world_size"]
    if saved_world == env.world_size:
        return states[env.rank]
    if all(s == states[0] for s in states):
        return states[0]
    raise ValueError(
        f"the data positions were saved by {saved_world} processes and differ by rank; they "
        f"cannot be resumed on {env.world_size} processes"
    )


def restore(
    cfg: RunConfig, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer, source: StepSource
) -> tuple[TrainState, Path | None]:
    """Resume from the run folder's latest checkpoint, else from ``load.path``; returns the counters."""
    # every rank verifies its checkpoint (sizes and SHA-256) and reads its part; damaged ones are skipped
    forced = cfg.load.force and cfg.load.path
    own = None
    if not forced:
        own = ckpt.load_latest_valid(
            cfg.run_dir / "checkpoints",
            cfg.load.start_fresh,
            load=_loader(env, model, optimizer, weights_only=False),
        )
    if own is not None:
        (path, loaded), mode = own, "resume"
    elif cfg.load.path:
        path, mode = Path(cfg.load.path), cfg.load.mode
        loaded = _loader(env, model, optimizer, weights_only=mode == "weights_only")(path)
    else:
        return TrainState(), None
    if mode == "weights_only":
        log.info("loaded model weights from %s (fresh optimizer, step 0)", path)
        return TrainState(), path
    _apply_optim_config(optimizer, cfg)
    saved = loaded["train_state"]
    state = TrainState(**{k: saved[k] for k in vars(TrainState())})
    same_world = saved["world_size"] == env.world_size
    if mode == "resume":
        source.load_state_dict(data_state_for(loaded, env))
        if same_world:
            _set_rng_state(loaded["rng"][env.rank])
            log.info("resumed from %s at step %d", path, state.step)
        else:
            log.info(
                "resumed from %s at step %d on %d processes (saved by %d): the same global sample count, "
                "new RNG streams",
                path,
                state.step,
                env.world_size,
                saved["world_size"],
            )
        return state, path
    if not cfg.load.reset_data:
        source.load_state_dict(data_state_for(loaded, env))
    if cfg.load.reset_step:
        state = TrainState()
    state.nonfinite_in_row = 0
    log.info("decay-only start from %s: model + optimizer loaded, step %d, new schedule", path, state.step)
    return state, path


def export_final(
    cfg: RunConfig, env: DistEnv, model: nn.Module, tokenizer: Any, checkpoint: Path | None = None
) -> Path | None:
    """``<run>/hf``: the trained model as a Hugging Face folder (``model.export_dtype`` or ``precision``).

    ``checkpoint``: the run's final sharded checkpoint (``dcp`` runs), streamed tensor by tensor;
    otherwise the full state dict is gathered to rank 0.
    """
    # "fp32" | "bf16": export formats of the same name (an fp64 reference run exports fp32)
    fmt = cfg.model.export_dtype or {"fp64": "fp32"}.get(cfg.model.precision, cfg.model.precision)
    if env.is_main:
        for stale in cfg.run_dir.glob(".tmp-hf-*"):  # a killed export's partial folder (we hold the run lock)
            shutil.rmtree(stale, ignore_errors=True)
            log.info("removed %s, left by an interrupted export", stale)
    out = None
    if checkpoint is not None and is_sharded_folder(checkpoint):
        if env.is_main:  # one full tensor in memory at a time
            out = export_model(
                model,
                tokenizer,
                cfg.run_dir / "hf",
                fmt=fmt,
                tensors=iter_model_tensors(checkpoint),
                overwrite=True,
            )
        return broadcast_object(out, env)  # type: ignore[return-value]
    model_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if env.is_main:
        out = export_model(model, tokenizer, cfg.run_dir / "hf", fmt=fmt, state_dict=model_sd, overwrite=True)  # type: ignore[arg-type]
    return broadcast_object(out, env)  # type: ignore[return-value]
