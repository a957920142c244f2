"""What a run is built from: the model and the data sources that ``cfg.model`` / ``cfg.data`` name.

``setup_model`` loads or builds the model, makes it trainable (fp32 masters, the FP8 swap of the
recipe), moves it to the device and shards it under torchrun. ``build_sources`` makes this rank's
training ``StepSource`` (``data.tokens.CptSource`` or ``data.sft.SftSource``) and a factory of its
validation steps; a new training-data kind is one branch here (and one ``DataConfig.kind``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data import (
    CptSource,
    SftSource,
    check_tokenized_by,
    folder_model_type,
    load_conversations,
    load_cpt_meta,
    load_tokenizer,
    load_tokens,
    val_batches,
)
from ..data.base import MicroBatch, StepSource
from ..data.tokens import check_batch_sizes
from ..fp8 import get_recipe
from ..model import build_from_config, check_model_folder, load_pretrained, prepare_for_training
from .config import RunConfig
from .distributed import DistEnv, shard_model

__all__ = [
    "ValSteps",
    "build_model",
    "build_sources",
    "check_inputs",
    "load_run_tokenizer",
    "rewinding",
    "setup_model",
    "total_steps",
]

log = logging.getLogger(__name__)

#: A function returning fresh validation steps (called before every evaluation).
ValSteps = Callable[[], Iterable[list[MicroBatch]]]


def check_inputs(cfg: RunConfig, world_size: int = 1, data: bool = True) -> None:
    """Check what the config names before anything is built: a clear error naming the key, in seconds.

    The model and tokenizer folders exist; with ``data`` (the run builds its own sources): the data
    files exist, SFT has its token budget, CPT's batch sizes divide over ``world_size`` ranks.
    """
    m, d = cfg.model, cfg.data
    if m.path:
        check_model_folder(m.path)
    if m.tokenizer and not Path(m.tokenizer).is_dir():
        raise FileNotFoundError(
            f"model.tokenizer: tokenizer folder not found: {m.tokenizer} (`infir2 demo "
            "--data-only --out DIR` writes a small one to DIR/tokenizer)"
        )
    if not data:
        return
    if not d.train_path:
        raise ValueError(
            "data.train_path: is required (cpt: a `infir2 prepare-cpt` folder; sft: a JSONL file)"
        )
    if d.kind == "cpt":
        for key, folder in (("data.train_path", d.train_path), ("data.val_path", d.val_path)):
            if folder:
                try:
                    load_cpt_meta(folder)
                except (FileNotFoundError, ValueError) as e:
                    raise type(e)(f"{key}: {e}") from None
        try:
            check_batch_sizes(d.global_batch_size, d.micro_batch_size, 0, world_size)
        except ValueError as e:
            raise ValueError(f"data.global_batch_size: {e}") from None
        return
    if d.max_tokens_per_micro_batch is None:
        raise ValueError("data.max_tokens_per_micro_batch: required for SFT (the token budget per forward)")
    for key, file in (("data.train_path", d.train_path), ("data.val_path", d.val_path)):
        if file and not Path(file).is_file():
            raise FileNotFoundError(f"{key}: SFT data file {file} does not exist")


def load_run_tokenizer(cfg: RunConfig) -> Any:
    """The run's tokenizer (``model.tokenizer`` or ``model.path``), read as ``AutoTokenizer`` will read the
    export: for the model's type (``from_config.arch``, or ``model_type`` in ``model.path/config.json``)."""
    path = cfg.model.tokenizer or cfg.model.path
    if not path:
        return None
    if cfg.model.from_config is not None:
        model_type = cfg.model.from_config.get("arch")
    else:
        model_type = folder_model_type(cfg.model.path) if cfg.model.path else None
    return load_tokenizer(path, model_type=model_type)


def build_model(cfg: RunConfig, tokenizer: Any) -> nn.Module:
    """The model ``cfg.model`` names: a local HF folder, or a seeded new one ``from_config``."""
    if cfg.model.path:
        return load_pretrained(cfg.model.path)
    if cfg.model.from_config:
        vocab_size = len(tokenizer) if tokenizer is not None else None
        return build_from_config(cfg.model.from_config, vocab_size=vocab_size, seed=cfg.run.seed)
    raise ValueError("model: give model.path (a local HF folder) or model.from_config")


def setup_model(cfg: RunConfig, env: DistEnv, model: nn.Module | None, tokenizer: Any) -> nn.Module:
    """``model`` (or the configured one) with fp32 masters and FP8 layers, on the device, sharded if distributed."""
    if cfg.model.precision == "bf16" and env.device.type == "cpu":
        log.warning(
            "model.precision=bf16 on a CPU: most CPUs have no fast bf16 (often 10-100x slower); "
            "fp32 is the CPU baseline (--set model.precision=fp32)"
        )
    model = model if model is not None else build_model(cfg, tokenizer)
    recipe = get_recipe(cfg.fp8.recipe)  # the config's name, resolved once (validated by train.config)
    master_dtype = torch.float64 if cfg.model.precision == "fp64" else torch.float32
    model = prepare_for_training(
        model,
        recipe,
        cfg.fp8.backend,
        cfg.model.activation_checkpointing,
        cfg.model.recompute_mlp,
        master_dtype,
    )
    model.to(env.device)
    if not env.distributed:
        return model
    return shard_model(model, cfg.model.precision, recipe.param_gather(cfg.fp8.param_gather))


def build_sources(cfg: RunConfig, tokenizer: Any, env: DistEnv) -> tuple[StepSource, ValSteps | None]:
    """This rank's training ``StepSource`` for ``cfg.data`` and a factory of its validation steps.

    CPT: windows of ``<train_path>/train.bin``; validation: the held-out windows of
    ``<val_path or train_path>/val.bin`` (``data.tokens.val_batches``, the windows ``infir2 eval
    --perplexity`` scores), ``micro_batch_size`` windows per step. SFT: ``SftSource`` over the JSONL
    (``data.epochs``, shuffled); validation: ``SftSource`` over ``val_path`` (one epoch, in file order).
    """
    d = cfg.data
    if not d.train_path:
        raise ValueError("data.train_path: is required")
    seed = d.seed if d.seed is not None else cfg.run.seed
    ranks = {"rank": env.rank, "world_size": env.world_size}
    if d.kind == "cpt":
        cpt_source = CptSource(
            d.train_path, d.seq_len, d.global_batch_size, d.micro_batch_size, seed=seed, **ranks
        )
        if tokenizer is not None:  # the shards must hold the ids the exported tokenizer produces
            check_tokenized_by(tokenizer, d.train_path)
        val_dir = d.val_path or d.train_path
        if len(load_tokens(val_dir, "val")) < 2:
            log.warning("%s/val.bin holds fewer than 2 tokens: no evaluation", val_dir)
            return cpt_source, None
        max_batches = cfg.train.eval_batches  # all ranks together: the same windows on any world size

        def cpt_val() -> Iterable[list[MicroBatch]]:
            batches = val_batches(
                val_dir, d.seq_len, d.micro_batch_size, max_batches, env.rank, env.world_size
            )
            return ([mb] for mb in batches)

        return cpt_source, cpt_val
    if tokenizer is None:
        raise ValueError("model.tokenizer: SFT data needs a tokenizer (model.tokenizer or model.path)")
    if d.max_tokens_per_micro_batch is None:
        raise ValueError("data.max_tokens_per_micro_batch: required for SFT (the token budget per forward)")
    sft = {
        "tokenizer": tokenizer,
        "global_batch_size": d.global_batch_size,
        "max_length": d.max_length,
        "max_tokens_per_micro_batch": d.max_tokens_per_micro_batch,
        "overlong": d.overlong,
        "seed": seed,
        "progress": env.is_main,
        **ranks,
    }
    train_source = SftSource(load_conversations(d.train_path), epochs=d.epochs, shuffle=d.shuffle, **sft)
    if not d.val_path:
        return train_source, None
    try:  # a file smaller than one batch would give no validation step: named here, before training
        val_source = SftSource(load_conversations(d.val_path), epochs=1, shuffle=False, **sft)
    except ValueError as e:
        raise ValueError(f"data.val_path: {d.val_path}: {e}") from None
    return train_source, rewinding(val_source)


def rewinding(source: StepSource) -> ValSteps:
    """Validation steps of a ``StepSource``: from its initial position at every evaluation."""
    start = source.state_dict()

    def steps() -> Iterable[list[MicroBatch]]:
        source.load_state_dict(start)
        return source

    return steps


def total_steps(cfg: RunConfig, source: StepSource) -> int:
    """``train.max_steps``, else the source's own length (an SFT source knows it)."""
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    total = getattr(source, "total_steps", None)
    if total is None and hasattr(source, "__len__"):
        total = len(source)  # type: ignore[arg-type]
    if total is None:
        raise ValueError("train.max_steps: required, because the data source does not know its length")
    return int(total)
