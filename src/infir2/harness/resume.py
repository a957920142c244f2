"""A run's persistence for every stage: save the state, resume it (or start from a checkpoint), export.

What a checkpoint holds is the same for ``infir2 train`` and ``infir2 rl`` (``checkpoint/``: the
folder, the ``full`` and ``dcp`` formats)::

    model, optimizer, scheduler {"step"},
    data         [the stage's data state, by saving rank]   (train: the StepSource position; rl: the
                                                             prompt stream, buffer and sampler, saved once)
    train_state  {the stage's counters, "world_size", "rng": [by rank: torch, python, cuda], "config"}

``save`` writes it (``SavePolicy``: the format, how many to keep, async DCP) and returns a
``PendingSave``; ``restore`` picks the run folder's newest checkpoint that verifies (damaged ones are
skipped with a warning; none loading is an error unless ``start_fresh``) of either format, else
``load.path`` (``infir2 train --load``), and applies ``load.mode``:

* ``resume`` -- everything; exactly (every RNG too) on the same number of processes. On another number
  model and optimizer are exact, the data continues at the same global sample count
  (:func:`data_state_for`) and each rank's RNG is seeded afresh (``run.seed + rank``);
* ``decay_only`` -- model + optimizer (the config's hyperparameters win), the step counter unless
  ``load.reset_step``, the data position unless ``load.reset_data``: a WSD decay from a stable checkpoint;
* ``weights_only`` -- the model only; a new run at step 0.

A checkpoint of another layout (the counters of another ``state_type``, ``data`` or ``rng`` not a list by
saving rank) is refused in one line naming the folder and what is expected: no release of infir2 has
been made, so no older layout is read (CONTRIBUTING.md, "Layouts no release has written").
``export_final`` writes ``<run>/hf`` with ``export.export_model`` (the code behind ``infir2 export``);
from a ``dcp`` checkpoint it streams the shards one tensor at a time.
"""

from __future__ import annotations

import logging
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

from .. import checkpoint as ckpt
from ..checkpoint import (
    PendingSave,
    check_room_for_saves,
    is_sharded_folder,
    iter_model_tensors,
    save_sharded,
)
from ..export import export_model
from .config import ModelConfig, OptimConfig
from .distributed import DistEnv, broadcast_object, gather_objects
from .optim import check_loaded_moments

__all__ = [
    "Counters",
    "LoadRequest",
    "PendingSave",
    "Replicated",
    "Resumable",
    "SavePolicy",
    "data_state_for",
    "export_final",
    "restore",
    "rng_state",
    "save",
]

log = logging.getLogger(__name__)


class Counters(Protocol):
    """A stage's counters (a dataclass saved under ``train_state``): what resuming reads and resets."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # a dataclass: its fields are what is saved
    step: int
    skipped_in_row: int


State = TypeVar("State", bound=Counters)


class Resumable(Protocol):
    """What a stage's data side must be to resume: ``state_dict`` / ``load_state_dict`` (a ``StepSource``
    is one). Its state is saved by every rank, unless it is a ``Replicated``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class Replicated:
    """The base of a data side whose state is the same on every rank (RL's ``RolloutData``): one copy
    is saved, and it resumes on any number of processes.

    A base class rather than a ``replicated`` attribute of ``Resumable``: ``isinstance`` is what the
    type checker follows, a ``StepSource`` declares nothing, and no flag can say False on a subclass."""


@dataclass(frozen=True)
class SavePolicy:
    """Where and how a stage saves: ``<run>/checkpoints``, ``full`` | ``dcp``, checkpoints kept."""

    root: Path
    fmt: str = "full"
    keep_last: int = 2
    async_save: bool = False


@dataclass(frozen=True)
class LoadRequest:
    """Where a run starts when its folder has no checkpoint of its own (``infir2 train``'s ``load``)."""

    path: str | None = None
    mode: str = "resume"
    reset_step: bool = False
    reset_data: bool = False
    force: bool = False


def rng_state() -> dict[str, Any]:
    """Every RNG a step may draw from: torch's CPU generator, Python's, and each CUDA device's."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _data_state(data: Resumable, env: DistEnv) -> list[Any] | None:
    if isinstance(data, Replicated):  # the same on every rank: rank 0's stands for all
        return [data.state_dict()] if env.is_main else None
    return gather_objects(data.state_dict(), env)


def save(
    policy: SavePolicy,
    env: DistEnv,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Resumable,
    state: Counters,
    config: dict[str, Any],
) -> PendingSave:
    """Write a checkpoint of ``policy.fmt`` atomically (all ranks call; all wait on the result).

    ``state``: the stage's counters (a dataclass with ``step``); ``config``: the resolved config."""
    counters = {**vars(state), "config": config}
    if policy.fmt == "dcp":
        extra = {"scheduler": {"step": state.step}, "train_state": counters, "data": data.state_dict()}
        extra["rng"] = rng_state()
        return save_sharded(
            policy.root, state.step, model, optimizer, extra, env, policy.keep_last, policy.async_save
        )
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    data_states, rng_states = _data_state(data, env), gather_objects(rng_state(), env)
    path = None
    if env.is_main:
        full = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": {"step": state.step},
            "data": data_states,
            "train_state": {**counters, "world_size": env.world_size, "rng": rng_states},
        }
        path = ckpt.save_checkpoint(policy.root, state.step, full, keep_last=policy.keep_last)
    written = broadcast_object(path, env)
    return PendingSave(None, lambda: written)


#: what ``train_state`` holds beside the stage's counters (``save``)
_BESIDE_COUNTERS = {"world_size", "rng", "config"}


def _check_layout(path: Path, loaded: dict[str, Any], state_type: type) -> None:
    """Refuse, in one line naming ``path``, a small state of another layout than ``save`` writes."""
    problems = [
        f"{k} is not a list by saving rank" for k in ("data", "rng") if not isinstance(loaded.get(k), list)
    ]
    counters = set(loaded["train_state"]) - _BESIDE_COUNTERS
    expected = {f.name for f in fields(state_type)}
    if counters != expected:
        problems.append(
            f"train_state holds the counters {', '.join(sorted(counters))}; {state_type.__name__} has "
            f"{', '.join(sorted(expected))}"
        )
    if problems:
        raise ckpt.older_layout(path, "; ".join(problems))


def _load_data(data: Resumable, loaded: dict[str, Any], env: DistEnv, path: Path) -> None:
    """This rank's data state from ``loaded`` into ``data``; a state that does not fit names ``path``."""
    try:
        data.load_state_dict(data_state_for(loaded, env))
    except (KeyError, ValueError) as e:
        why = str(e) if isinstance(e, ValueError) else f"no {e} in its data state"
        raise ValueError(f"checkpoint {path}: {why}") from e


def data_state_for(loaded: dict[str, Any], env: DistEnv) -> Any:
    """This rank's data state from a checkpoint's small state.

    The sources' states are positions in the *global* sample order, the same on every rank. On the
    same world size each rank gets its own state back; a state saved once (a ``Replicated`` data side's) or by ranks
    that all saved the same one is valid on any world size (the run continues at the same global
    sample count). A source whose per-rank states differ cannot be resumed on another world size (a
    ``ValueError`` says so).
    """
    states, saved_world = loaded["data"], loaded["train_state"]["world_size"]
    if len(states) == 1:
        return states[0]
    if saved_world == env.world_size:
        return states[env.rank]
    if all(s == states[0] for s in states):
        return states[0]
    raise ValueError(
        f"the data positions were saved by {saved_world} processes and differ by rank; they "
        f"cannot be resumed on {env.world_size} processes"
    )


def _counters(state_type: type[State], saved: dict[str, Any]) -> State:
    return state_type(**{f.name: saved[f.name] for f in fields(state_type)})


def _apply_optim_config(optimizer: torch.optim.Optimizer, optim_cfg: OptimConfig) -> None:
    """After loading optimizer state, the config's hyperparameters win (a decay-only run may change them)."""
    for i, group in enumerate(optimizer.param_groups):
        weight_decay = optim_cfg.weight_decay if i == 0 else 0.0
        group.update(betas=optim_cfg.betas, eps=optim_cfg.eps, weight_decay=weight_decay)


def _find(
    policy: SavePolicy,
    env: DistEnv,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    load: LoadRequest,
    start_fresh: bool,
) -> tuple[Path, dict[str, Any], str] | None:
    """The checkpoint to start from: the run's own newest loadable one, else ``load.path``; loaded.
    First the disk is checked for the run's saves (``checkpoint.check_room_for_saves``: their bytes are
    known from the model and the optimizer's config): a first save that cannot fit is refused now."""
    check_room_for_saves(policy.root.parent, model, optimizer, policy.keep_last)

    def loader(weights_only: bool) -> Callable[[Path], dict[str, Any]]:
        return lambda folder: ckpt.load_into(folder, model, None if weights_only else optimizer, env)

    if not (load.force and load.path):  # every rank verifies (sizes, SHA-256) and reads its part
        own = ckpt.load_latest_valid(policy.root, start_fresh, load=loader(False))
        if own is not None:
            return own[0], own[1], "resume"
    if load.path:
        path = Path(load.path)
        return path, loader(load.mode == "weights_only")(path), load.mode
    return None


def restore(
    policy: SavePolicy,
    env: DistEnv,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Resumable,
    state_type: type[State],
    optim_cfg: OptimConfig,
    load: LoadRequest | None = None,
    start_fresh: bool = False,
) -> tuple[State, Path | None]:
    """Resume from the run folder's latest checkpoint, else from ``load.path``; returns the counters."""
    load = load or LoadRequest()
    found = _find(policy, env, model, optimizer, load, start_fresh)
    if found is None:
        return state_type(), None
    path, loaded, mode = found
    if mode == "weights_only":
        log.info("loaded model weights from %s (fresh optimizer, step 0)", path)
        return state_type(), path
    _check_layout(path, loaded, state_type)
    check_loaded_moments(optimizer, str(path))
    _apply_optim_config(optimizer, optim_cfg)
    state = _counters(state_type, loaded["train_state"])
    saved_world = loaded["train_state"]["world_size"]
    if mode == "resume":
        _load_data(data, loaded, env, path)
        if saved_world == env.world_size:
            _set_rng_state(loaded["rng"][env.rank])
            log.info("resumed from %s at step %d", path, state.step)
        else:
            log.info(
                "resumed from %s at step %d on %d processes (saved by %d): the same global sample count, "
                "new RNG streams",
                path,
                state.step,
                env.world_size,
                saved_world,
            )
        return state, path
    if not load.reset_data:
        _load_data(data, loaded, env, path)
    if load.reset_step:
        state = state_type()
    state.skipped_in_row = 0
    log.info("decay-only start from %s: model + optimizer loaded, step %d, new schedule", path, state.step)
    return state, path


def export_final(
    run_dir: Path,
    env: DistEnv,
    model: nn.Module,
    tokenizer: Any,
    model_cfg: ModelConfig,
    checkpoint: Path | None = None,
) -> Path | None:
    """``<run>/hf``: the trained model as a Hugging Face folder (``model.export_dtype`` or ``precision``).

    ``checkpoint``: the run's final sharded checkpoint (``dcp`` runs), streamed tensor by tensor;
    otherwise the full state dict is gathered to rank 0. Every rank calls this.
    """
    # "fp32" | "bf16": export formats of the same name (an fp64 reference run exports fp32)
    fmt = model_cfg.export_dtype or {"fp64": "fp32"}.get(model_cfg.precision, model_cfg.precision)
    if env.is_main:
        for stale in run_dir.glob(".tmp-hf-*"):  # a killed export's partial folder (we hold the run lock)
            shutil.rmtree(stale, ignore_errors=True)
            log.info("removed %s, left by an interrupted export", stale)
    out = None
    if checkpoint is not None and is_sharded_folder(checkpoint):
        if env.is_main:  # one full tensor in memory at a time
            tensors = iter_model_tensors(checkpoint)
            out = export_model(model, tokenizer, run_dir / "hf", fmt=fmt, tensors=tensors, overwrite=True)
        return broadcast_object(out, env)
    model_sd = _full_model_state(model)
    if env.is_main:
        out = export_model(model, tokenizer, run_dir / "hf", fmt=fmt, state_dict=model_sd, overwrite=True)
    return broadcast_object(out, env)


def _full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict in CPU memory on rank 0 (every rank calls: it gathers the shards).

    ``full_state_dict=True`` makes every value a plain tensor (a DTensor is gathered into one), which
    ``get_model_state_dict``'s type, a union of every kind of value, does not say: the one cast."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
