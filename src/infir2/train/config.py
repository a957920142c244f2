"""Run configs: YAML files validated into nested dataclasses, with ``--set key=value`` overrides.

A run config has nine sections (``infir2 config --keys`` prints every key with its default and its
meaning, from the ``help`` of the fields below; all hyperparameters of the InfiR2 recipe,
docs/RECIPE.md section 2, can be written down)::

    run:      name, out_dir, seed, device (auto|cpu|cuda), accept_config_changes
    model:    path (local HF folder) | from_config ({arch: a name in infir2.model.ARCHS, hidden_size, ...}),
              tokenizer, precision (fp32|bf16|fp64), activation_checkpointing, recompute_mlp, recompute_norm,
              mlp_saved_fp8, export_dtype
    fp8:      recipe (a name in infir2.fp8.RECIPES: bf16, blockwise, ...), backend, param_gather, weight_cache,
              stats_every
    data:     kind (cpt|sft), train_path, val_path, seq_len, global_batch_size, micro_batch_size,
              max_tokens_per_micro_batch, max_length, overlong (truncate|drop), epochs, shuffle, seed
    optim:    lr, betas, eps, weight_decay, grad_clip, fused, state_dtype (fp32|bf16|fp8), fp8_block, fp8_second_moment, fp8_range_expansion
    schedule: name (wsd|cosine|constant), warmup_steps | warmup_fraction, decay_steps | decay_fraction,
              decay_style (cosine|linear), min_lr | min_lr_ratio
    train:    max_steps, save_every, keep_last, log_every, eval_every, max_skipped_in_row (the keys of
              harness.config.TrainSection), eval_from, eval_batches, eval_fp8, loss_spike_nats,
              loss_spike_window, loss_chunk_tokens (auto|0|N), checkpoint_format (auto|full|dcp), async_save
    load:     path, mode (resume|decay_only|weights_only), reset_step, reset_data, force, start_fresh
    parallel: context (processes that share each sequence; docs/DISTRIBUTED.md)

Validation is strict: an unknown key, a value of the wrong type or outside its allowed set (for
``fp8.recipe`` and ``model.from_config.arch``: the names of their registries) is a ``ValueError``
naming the dotted key and the file; the type checks against the annotations below are
``typed_yaml.build``'s, the rules between fields are ``_check``'s (those of the sections ``infir2 rl``
shares, run / model / fp8 / optim / parallel and the ``TrainSection`` keys, are ``harness.config``'s). Numbers written as ``1e-4`` (which PyYAML reads as
a string) are accepted for float fields. Overrides use the same dotted keys and are typed by the
field: ``--set optim.lr=3e-4 --set data.shuffle=false --set optim.betas=[0.9,0.95]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from ..fp8.formats import BLOCK
from ..harness.config import MEANINGFUL as SHARED_MEANINGFUL
from ..harness.config import (
    Fp8Config,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunSection,
    ScheduleConfig,
    StageConfig,
    TrainSection,
    check_positive,
    check_shared,
    check_stage,
    config_to_dict,
    load_stage_config,
    resolve_config_path,
    save_config,
    setting,
)
from ..harness.config import key_reference as _key_reference
from ..harness.typed_yaml import apply_overrides, build, config_error

__all__ = [
    "MEANINGFUL",
    "DataConfig",
    "Fp8Config",
    "LoadConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RunConfig",
    "RunSection",
    "ScheduleConfig",
    "TrainConfig",
    "apply_overrides",
    "config_to_dict",
    "key_reference",
    "load_config",
    "parse_config",
    "resolve_checkpoint_format",
    "save_config",
]

#: the shared sections' meaningful keys, and a training run's schedule: a function of ``train.max_steps``
MEANINGFUL = (*SHARED_MEANINGFUL, "schedule.", "train.max_steps")


@dataclass(frozen=True)
class DataConfig:
    kind: Literal["cpt", "sft"] = setting(
        "cpt", "cpt: token shards from `infir2 prepare-cpt`; sft: chat JSONL/Parquet"
    )
    train_path: str = setting(
        "", "required. cpt: token-shard folder (train.bin + meta.json); sft: a JSONL file"
    )
    val_path: str | None = setting(
        None, "cpt: a shard folder (val.bin; default: train_path's); sft: a JSONL file"
    )
    seq_len: int = setting(2048, "cpt: window length in tokens")
    global_batch_size: int = setting(
        8, "sequences (cpt) or samples (sft) per optimizer step, all ranks together"
    )
    micro_batch_size: int = setting(1, "cpt: sequences per forward")
    max_tokens_per_micro_batch: int | None = setting(
        None, "sft (required): token budget per forward (the authors' max_tokens_per_gpu)"
    )
    max_length: int = setting(32768, "sft: longest sample in tokens")
    overlong: Literal["truncate", "drop"] = setting(
        "truncate", "sft: what happens to samples over max_length"
    )
    epochs: int = setting(1, "passes over the data (sft); cpt runs are sized by train.max_steps")
    shuffle: bool = setting(True, "shuffle the training data each epoch")
    seed: int | None = setting(None, "data order seed; default: run.seed")


@dataclass(frozen=True)
class TrainConfig(TrainSection):
    eval_from: int = setting(
        0, "no periodic evaluation before this step (0 = from the start; the last step is evaluated anyway)"
    )
    eval_batches: int = setting(
        8, "validation batches per evaluation, all ranks together (the same held-out data on any world size)"
    )
    eval_fp8: bool = setting(
        False, "evaluate with FP8 GEMMs (default: high precision, as the exported model runs)"
    )
    loss_spike_nats: float | None = setting(
        3.0,
        "skip the update of a step whose loss is this many nats above the median of the last "
        "loss_spike_window steps (its tokens e^3 = 20x less likely: divergence, not noise); null = off",
    )
    loss_spike_window: int = setting(32, "updated steps whose median loss is the spike guard's reference")
    loss_chunk_tokens: int | Literal["auto"] = setting(
        "auto",
        "chunked LM-head loss: tokens per chunk; 0 = never; auto = chunks whose fp32 logits stay under "
        "256 MiB whatever the vocabulary (441 tokens at 151,936 words), when the whole logits would not",
    )
    checkpoint_format: Literal["auto", "full", "dcp"] = field(
        default="auto",
        metadata={
            "help": (
                "auto: dcp when the run has several processes (or async_save), else full. full: gathered to rank 0, "
                "one state.pt (rank 0 holds ~12 bytes per parameter while saving). dcp: torch.distributed.checkpoint, "
                "every rank writes its own shards (what multi-GPU runs want; loads on any number of processes)"
            )
        },
    )
    async_save: bool = setting(
        False, "dcp only: write in a background thread, the loop does not wait for the disk"
    )


@dataclass(frozen=True)
class LoadConfig:
    path: str | None = setting(None, "a checkpoint folder (step_XXXXXXXX) to start from (`--load`)")
    mode: Literal["resume", "decay_only", "weights_only"] = setting(
        "resume", "resume: everything; decay_only: weights + optimizer, a new schedule; weights_only: weights"
    )
    reset_step: bool = setting(
        False, "decay_only: restart the step counter at 0 (the new schedule starts fresh)"
    )
    reset_data: bool = setting(
        False, "decay_only: start the data from the beginning instead of where it stopped"
    )
    force: bool = setting(False, "use `path` even when the run folder has checkpoints (set by `--load`)")
    start_fresh: bool = setting(
        False, "if none of the run's checkpoints loads: set them aside, start at step 0"
    )


@dataclass(frozen=True)
class RunConfig(StageConfig):
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


# --------------------------------------------------------------------------------------------
# Rules beyond the types (the type checks are ``typed_yaml.build``'s)


def _check(cfg: RunConfig, source: str) -> None:
    """Cross-field rules that types alone cannot express (the shared sections': ``harness.config``)."""
    check_shared(cfg, cfg.optim, cfg.train, cfg.parallel, source)
    d, t = cfg.data, cfg.train
    for key in ("seq_len", "global_batch_size", "micro_batch_size", "max_length", "epochs"):
        check_positive(source, f"data.{key}", getattr(d, key))
    check_positive(source, "data.max_tokens_per_micro_batch", d.max_tokens_per_micro_batch)
    if (
        d.kind == "sft"
        and d.max_tokens_per_micro_batch is not None
        and d.max_length > d.max_tokens_per_micro_batch
    ):
        raise config_error(
            source,
            "data.max_length",
            f"{d.max_length} exceeds data.max_tokens_per_micro_batch={d.max_tokens_per_micro_batch}: "
            "a sample of max_length tokens must fit in one micro-batch",
        )
    _check_schedule(cfg.schedule, source)
    if t.loss_chunk_tokens != "auto":
        check_positive(source, "train.loss_chunk_tokens", t.loss_chunk_tokens, allow_zero=True)
    check_positive(source, "train.eval_from", t.eval_from, allow_zero=True)
    for key in ("eval_batches", "loss_spike_nats", "loss_spike_window"):
        check_positive(source, f"train.{key}", getattr(t, key))  # None (no spike guard) passes
    if t.async_save and t.checkpoint_format == "full":
        raise config_error(source, "train.async_save", "needs train.checkpoint_format: dcp (or auto)")
    if cfg.load.mode != "resume" and cfg.load.path is None:
        raise config_error(source, "load.path", f"load.mode {cfg.load.mode!r} needs a checkpoint path")
    context = cfg.parallel.context
    if context > 1 and d.kind == "cpt" and d.seq_len % (context * BLOCK):
        raise config_error(
            source,
            "data.seq_len",
            f"{d.seq_len} does not split into parallel.context={context} shards of a multiple of "
            f"{BLOCK} tokens (make it a multiple of {context * BLOCK})",
        )


def _check_schedule(s: ScheduleConfig, source: str) -> None:
    if s.warmup_steps is not None and s.warmup_fraction is not None:
        raise config_error(source, "schedule.warmup_steps", "give warmup_steps or warmup_fraction, not both")
    if s.decay_steps is not None and s.decay_fraction is not None:
        raise config_error(source, "schedule.decay_steps", "give decay_steps or decay_fraction, not both")
    if s.min_lr is not None and s.min_lr_ratio is not None:
        raise config_error(source, "schedule.min_lr", "give min_lr or min_lr_ratio, not both")
    for key in ("warmup_fraction", "decay_fraction", "min_lr_ratio"):
        value = getattr(s, key)
        if value is not None and not 0 <= value <= 1:
            raise config_error(source, f"schedule.{key}", f"must be in [0, 1], got {value}")
    for key in ("warmup_steps", "decay_steps", "min_lr"):
        check_positive(source, f"schedule.{key}", getattr(s, key), allow_zero=True)


def resolve_checkpoint_format(cfg: RunConfig, world_size: int) -> RunConfig:
    """``cfg`` with ``train.checkpoint_format: auto`` resolved for ``world_size`` processes.

    auto is ``dcp`` (every rank writes its shards) when there are several processes or ``async_save``
    is on, else ``full`` (one ``state.pt``, which the single-process tools read).
    """
    t = cfg.train
    if t.checkpoint_format != "auto":
        return cfg
    several = world_size > 1 or t.async_save
    return replace(cfg, train=replace(t, checkpoint_format="dcp" if several else "full"))


def parse_config(data: dict[str, Any], source: str = "<dict>") -> RunConfig:
    """Validate a nested dict (e.g. parsed YAML) into a ``RunConfig``; ``source`` names it in errors."""
    check_stage(
        data, source, ("rollout", "algo", "guard", "vllm", "data.prompts_path"), "infir2 rl"
    )  # sections RunConfig has not
    cfg = build(RunConfig, data, "", source)
    _check(cfg, source)
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML run config (a file, or a shipped one by name), apply ``--set`` overrides, validate.
    Errors name the key and the file."""
    return load_stage_config(resolve_config_path(path), parse_config, overrides)


def key_reference() -> list[tuple[str, Any, str]]:
    """Every config key as ``(dotted key, default, meaning)``, in the order of the sections."""
    return _key_reference(RunConfig())
