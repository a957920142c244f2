"""What a training run is built from beyond the harness: its inputs checked and its data sources.

``check_inputs`` checks the folders and files a config names before anything is built (the model's
through ``harness.setup.check_model_inputs``). ``build_sources`` makes this rank's
training ``StepSource`` (``data.tokens.CptSource`` or ``data.sft.SftSource``) and a factory of its
validation steps; a new training-data kind is one branch here (and one ``DataConfig.kind``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..data import (
    CptSource,
    SftSource,
    check_tokenized_by,
    load_conversations,
    load_cpt_meta,
    load_tokens,
    val_batches,
)
from ..data.base import MicroBatch, StepSource
from ..data.tokens import check_batch_sizes
from ..harness.distributed import DistEnv, data_ranks
from ..harness.grads import check_grad_dtype
from ..harness.setup import check_model_inputs
from .config import RunConfig

__all__ = ["ValSteps", "build_sources", "check_inputs", "rewinding", "total_steps"]

#: A function returning fresh validation steps (called before every evaluation).
ValSteps = Callable[[], Iterable[list[MicroBatch]]]

log = logging.getLogger(__name__)


def check_inputs(cfg: RunConfig, world_size: int = 1, data: bool = True) -> None:
    """Check what the config names before anything is built: a clear error naming the key, in seconds.

    The model and tokenizer folders exist; with ``data`` (the run builds its own sources): the data
    files exist, SFT has its token budget, CPT's batch sizes divide over the data ranks (``world_size``
    over ``parallel.context``, which must divide it).
    """
    d, context = cfg.data, cfg.parallel.context
    check_model_inputs(cfg)
    check_grad_dtype(cfg.optim.grad_dtype, world_size)
    world_size = data_ranks(world_size, context)  # a context group shares its sequences
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
        if file and Path(file).is_dir():
            raise ValueError(f"{key}: {file} is a folder; SFT data is a JSONL file")
        if file and not Path(file).is_file():
            raise FileNotFoundError(f"{key}: SFT data file {file} does not exist")


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
