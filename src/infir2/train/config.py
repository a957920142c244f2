"""Run configs: YAML files validated into nested dataclasses, with ``--set key=value`` overrides.

A run config has eight sections (``infir2 config --keys`` prints every key with its default and its
meaning, from the ``help`` of the fields below; all hyperparameters of the InfiR2 recipe,
docs/RECIPE.md section 2, can be written down)::

    run:      name, out_dir, seed, device (auto|cpu|cuda)
    model:    path (local HF folder) | from_config ({arch: a name in infir2.model.ARCHS, hidden_size, ...}),
              tokenizer, precision (fp32|bf16|fp64), activation_checkpointing, recompute_mlp, export_dtype
    fp8:      recipe (a name in infir2.fp8.RECIPES: bf16, blockwise, ...), backend, param_gather, stats_every
    data:     kind (cpt|sft), train_path, val_path, seq_len, global_batch_size, micro_batch_size,
              max_tokens_per_micro_batch, max_length, overlong (truncate|drop), epochs, shuffle, seed
    optim:    lr, betas, eps, weight_decay, grad_clip, fused, state_dtype (fp32|bf16)
    schedule: name (wsd|cosine|constant), warmup_steps | warmup_fraction, decay_steps | decay_fraction,
              decay_style (cosine|linear), min_lr | min_lr_ratio
    train:    max_steps, eval_every, eval_batches, eval_fp8, save_every, keep_last, log_every,
              max_nonfinite_in_row, loss_spike_nats, loss_spike_window, loss_chunk_tokens (auto|0|N),
              checkpoint_format (auto|full|dcp), async_save
    load:     path, mode (resume|decay_only|weights_only), reset_step, reset_data, force, start_fresh,
              accept_config_changes

Validation is strict: an unknown key, a value of the wrong type or outside its allowed set (for
``fp8.recipe`` and ``model.from_config.arch``: the names of their registries) is a ``ValueError``
naming the dotted key and the file; the type checks against the annotations below are
``typed_yaml.build``'s, the rules between fields are ``_check``'s. Numbers written as ``1e-4`` (which PyYAML reads as
a string) are accepted for float fields. Overrides use the same dotted keys and are typed by the
field: ``--set optim.lr=3e-4 --set data.shuffle=false --set optim.betas=[0.9,0.95]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from ..fp8 import RECIPES
from ..model import ARCHS
from .typed_yaml import apply_overrides, build, config_error, to_plain

#: the largest finite float32: optimizer hyperparameters above it become inf inside fp32 AdamW
FP32_MAX = 3.4028234663852886e38
#: the largest peak learning rate accepted: AdamW's update is about lr per element, so lr > 1 moves every
#: weight by more than its typical size (~0.02) fifty times over in one step
MAX_LR = 1.0

__all__ = [
    "DataConfig",
    "Fp8Config",
    "LoadConfig",
    "ModelConfig",
    "OptimConfig",
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
    "resolve_config_path",
    "save_config",
    "shipped_configs",
]


def _key(default: Any, meaning: str) -> Any:
    """A config field with its default and its meaning (``infir2 config --keys`` prints both)."""
    return field(default=default, metadata={"help": meaning})


@dataclass(frozen=True)
class RunSection:
    name: str = _key("run", "the run folder is <out_dir>/<name>")
    out_dir: str = _key("runs", "parent folder of the run folder")
    seed: int = _key(0, "seed of the model init (from_config), dropout and the data order (unless data.seed)")
    device: Literal["auto", "cpu", "cuda"] = _key(
        "auto", "auto: cuda when available (torchrun: one GPU per rank)"
    )


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = _key(None, "local Hugging Face folder (config.json + weights), loaded without network")
    from_config: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": (
                "a seeded new model instead: {arch: qwen2|llama, hidden_size: ..., num_hidden_layers: ...} "
                "(any field of the architecture's transformers config)"
            )
        },
    )
    tokenizer: str | None = _key(None, "tokenizer folder; default: model.path (required with from_config)")
    precision: Literal["fp32", "bf16", "fp64"] = _key(
        "bf16",
        "autocast dtype of the high-precision parts (masters stay fp32); fp32 on CPUs; fp64: masters, "
        "high-precision parts and the emulated GEMMs' accumulation in float64 (a CPU-independent reference "
        "for tests; slow)",
    )
    activation_checkpointing: bool = _key(False, "recompute each decoder layer in backward (long contexts)")
    recompute_mlp: bool = _key(
        True,
        "SwiGLU MLPs keep gate and up outputs and recompute silu in backward (exact; saves 2 [T, I] tensors)",
    )
    export_dtype: Literal["fp32", "bf16"] | None = _key(
        None, "dtype of the final <run>/hf export; default: precision (fp32 for an fp64 run)"
    )


@dataclass(frozen=True)
class Fp8Config:
    recipe: str = _key("blockwise", f"FP8 recipe, one of: {', '.join(RECIPES)} (bf16 = no FP8)")
    backend: str | None = _key(None, "force a GEMM backend (emulated, scaled_mm, ...); default: automatic")
    param_gather: bool | None = _key(
        None,
        "FSDP2: all-gather FP8 linears' weights as FP8 codes (1 byte/element); default (null): on for "
        "the blockwise recipes; only recipes whose fprop and dgrad share the weight blocks can (not rowwise)",
    )
    stats_every: int = _key(0, "FP8 numerics telemetry (`infir2 numerics`) every N steps; 0 = off")


@dataclass(frozen=True)
class DataConfig:
    kind: Literal["cpt", "sft"] = _key(
        "cpt", "cpt: token shards from `infir2 prepare-cpt`; sft: chat JSONL/Parquet"
    )
    train_path: str = _key("", "required. cpt: token-shard folder (train.bin + meta.json); sft: a JSONL file")
    val_path: str | None = _key(
        None, "cpt: a shard folder (val.bin; default: train_path's); sft: a JSONL file"
    )
    seq_len: int = _key(2048, "cpt: window length in tokens")
    global_batch_size: int = _key(
        8, "sequences (cpt) or samples (sft) per optimizer step, all ranks together"
    )
    micro_batch_size: int = _key(1, "cpt: sequences per forward")
    max_tokens_per_micro_batch: int | None = _key(
        None, "sft (required): token budget per forward (the authors' max_tokens_per_gpu)"
    )
    max_length: int = _key(32768, "sft: longest sample in tokens")
    overlong: Literal["truncate", "drop"] = _key("truncate", "sft: what happens to samples over max_length")
    epochs: int = _key(1, "passes over the data (sft); cpt runs are sized by train.max_steps")
    shuffle: bool = _key(True, "shuffle the training data each epoch")
    seed: int | None = _key(None, "data order seed; default: run.seed")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = _key(1e-4, "peak learning rate of AdamW")
    betas: tuple[float, float] = _key((0.9, 0.95), "AdamW betas")
    eps: float = _key(1e-8, "AdamW eps")
    weight_decay: float = _key(0.1, "on >=2-D weights (incl. embeddings); never on norms or biases")
    grad_clip: float = _key(1.0, "max global grad norm; 0 = no clipping")
    fused: bool | None = _key(None, "AdamW implementation: null = fused on CUDA, foreach elsewhere")
    state_dtype: Literal["fp32", "bf16"] = _key(
        "fp32", "AdamW moments' storage (math is fp32): 16 vs 12 bytes per parameter"
    )


@dataclass(frozen=True)
class ScheduleConfig:
    name: Literal["wsd", "cosine", "constant"] = _key(
        "wsd", "learning-rate schedule: warmup-stable-decay, cosine, constant"
    )
    warmup_steps: int | None = _key(None, "linear warmup steps; exclusive with warmup_fraction")
    warmup_fraction: float | None = _key(None, "warmup as a fraction of the total steps (e.g. 0.05)")
    decay_steps: int | None = _key(None, "wsd: the last decay_steps decay; exclusive with decay_fraction")
    decay_fraction: float | None = _key(None, "wsd: the last fraction of the steps decays")
    decay_style: Literal["cosine", "linear"] = _key("cosine", "wsd decay shape")
    min_lr: float | None = _key(None, "final learning rate; exclusive with min_lr_ratio")
    min_lr_ratio: float | None = _key(None, "final learning rate as a fraction of optim.lr")


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int | None = _key(None, "optimizer steps; null: as many as the data yields (data.epochs)")
    eval_every: int = _key(
        0, "steps between evaluations; 0 = none (the last step is still evaluated when val data exists)"
    )
    eval_batches: int = _key(
        8, "validation batches per evaluation, all ranks together (the same held-out data on any world size)"
    )
    eval_fp8: bool = _key(
        False, "evaluate with FP8 GEMMs (default: high precision, as the exported model runs)"
    )
    save_every: int = _key(0, "steps between checkpoints; 0 = only at the end")
    keep_last: int = _key(2, "checkpoints kept in <run>/checkpoints")
    log_every: int = _key(1, "steps between progress-bar / stdout updates (metrics.jsonl gets every step)")
    max_nonfinite_in_row: int = _key(
        3, "consecutive skipped steps (non-finite loss or grad norm, or a loss spike) that stop the run"
    )
    loss_spike_nats: float | None = _key(
        3.0,
        "skip the update of a step whose loss is this many nats above the median of the last "
        "loss_spike_window steps (its tokens e^3 = 20x less likely: divergence, not noise); null = off",
    )
    loss_spike_window: int = _key(32, "updated steps whose median loss is the spike guard's reference")
    loss_chunk_tokens: int | Literal["auto"] = _key(
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
    async_save: bool = _key(
        False, "dcp only: write in a background thread, the loop does not wait for the disk"
    )


@dataclass(frozen=True)
class LoadConfig:
    path: str | None = _key(None, "a checkpoint folder (step_XXXXXXXX) to start from (`--load`)")
    mode: Literal["resume", "decay_only", "weights_only"] = _key(
        "resume", "resume: everything; decay_only: weights + optimizer, a new schedule; weights_only: weights"
    )
    reset_step: bool = _key(
        False, "decay_only: restart the step counter at 0 (the new schedule starts fresh)"
    )
    reset_data: bool = _key(
        False, "decay_only: start the data from the beginning instead of where it stopped"
    )
    force: bool = _key(False, "use `path` even when the run folder has checkpoints (set by `--load`)")
    start_fresh: bool = _key(False, "if none of the run's checkpoints loads: set them aside, start at step 0")
    accept_config_changes: bool = _key(
        False,
        "resume although schedule/optim/data/model/fp8/seed/max_steps changed (`--accept-config-changes`)",
    )


@dataclass(frozen=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    load: LoadConfig = field(default_factory=LoadConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name


# --------------------------------------------------------------------------------------------
# Rules beyond the types (the type checks are ``typed_yaml.build``'s)


def _check(cfg: RunConfig, source: str) -> None:
    """Cross-field rules that types alone cannot express."""

    def positive(key: str, value: float | None, allow_zero: bool = False) -> None:
        if value is not None and not math.isfinite(value):
            raise config_error(source, key, f"must be a finite number, got {value}")
        if value is not None and abs(value) > FP32_MAX:
            raise config_error(source, key, f"overflows float32 (max {FP32_MAX:.4g}), got {value}")
        if value is not None and (value < 0 or (value == 0 and not allow_zero)):
            raise config_error(source, key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")

    m, d, o, s, t = cfg.model, cfg.data, cfg.optim, cfg.schedule, cfg.train
    if m.path is not None and m.from_config is not None:
        raise config_error(
            source, "model", "give one of model.path (a local HF folder) or model.from_config, not both"
        )
    if m.from_config is not None and m.from_config.get("arch") not in ARCHS:
        raise config_error(
            source,
            "model.from_config.arch",
            f"got {m.from_config.get('arch')!r}, expected one of {', '.join(ARCHS)}",
        )
    if cfg.fp8.recipe not in RECIPES:
        raise config_error(
            source, "fp8.recipe", f"got {cfg.fp8.recipe!r}, expected one of {', '.join(RECIPES)}"
        )
    if m.from_config is not None and m.tokenizer is None:
        raise config_error(source, "model.tokenizer", "a model built from_config needs a tokenizer folder")
    for key in ("seq_len", "global_batch_size", "micro_batch_size", "max_length", "epochs"):
        positive(f"data.{key}", getattr(d, key))
    positive("data.max_tokens_per_micro_batch", d.max_tokens_per_micro_batch)
    if (
        d.kind == "sft"
        and d.max_tokens_per_micro_batch is not None
        and d.max_length > d.max_tokens_per_micro_batch
    ):
        raise config_error(
            source,
            "data.max_length",
            f"{d.max_length} exceeds data.max_tokens_per_micro_batch="
            f"{d.max_tokens_per_micro_batch}: a sample of max_length tokens must fit in one "
            "micro-batch",
        )
    positive("optim.lr", o.lr)
    if o.lr > MAX_LR:
        raise config_error(
            source,
            "optim.lr",
            f"{o.lr:g} is above {MAX_LR:g}: no AdamW run uses such a learning "
            "rate (LM pre-training and SFT peak at 1e-5 .. 1e-2); the weights would diverge",
        )
    positive("optim.eps", o.eps)
    positive("optim.weight_decay", o.weight_decay, allow_zero=True)
    positive("optim.grad_clip", o.grad_clip, allow_zero=True)
    for i, beta in enumerate(o.betas):
        if not 0 <= beta < 1:
            raise config_error(source, f"optim.betas[{i}]", f"must be in [0, 1), got {beta}")
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
    positive("schedule.warmup_steps", s.warmup_steps, allow_zero=True)
    positive("schedule.decay_steps", s.decay_steps, allow_zero=True)
    positive("schedule.min_lr", s.min_lr, allow_zero=True)
    positive("train.max_steps", t.max_steps)
    if t.loss_chunk_tokens != "auto":
        positive("train.loss_chunk_tokens", t.loss_chunk_tokens, allow_zero=True)
    positive("fp8.stats_every", cfg.fp8.stats_every, allow_zero=True)
    for key in ("eval_every", "save_every"):
        positive(f"train.{key}", getattr(t, key), allow_zero=True)
    if t.loss_spike_nats is not None:
        positive("train.loss_spike_nats", t.loss_spike_nats)
    for key in ("eval_batches", "keep_last", "log_every", "max_nonfinite_in_row", "loss_spike_window"):
        positive(f"train.{key}", getattr(t, key))
    if cfg.fp8.param_gather and not RECIPES[cfg.fp8.recipe].gathers_fp8_weight:
        raise config_error(
            source,
            "fp8.param_gather",
            f"recipe {cfg.fp8.recipe} has no FP8 weight that serves both "
            "fprop and dgrad; set fp8.param_gather to false or null",
        )
    if t.async_save and t.checkpoint_format == "full":
        raise config_error(source, "train.async_save", "needs train.checkpoint_format: dcp (or auto)")
    if cfg.load.mode != "resume" and cfg.load.path is None:
        raise config_error(source, "load.path", f"load.mode {cfg.load.mode!r} needs a checkpoint path")


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
    cfg = build(RunConfig, data, "", source)
    _check(cfg, source)
    return cfg


def shipped_configs() -> dict[str, Path]:
    """The run configs installed with the package (``infir2/configs/*.yaml``), by name (no ``.yaml``)."""
    folder = Path(str(resources.files("infir2") / "configs"))
    return {path.stem: path for path in sorted(folder.glob("*.yaml"))}


def resolve_config_path(name: str | Path) -> Path:
    """A run config file: ``name`` if it is a file, else the shipped config of that name.

    ``tiny-cpt``, ``tiny-cpt.yaml`` and ``src/infir2/configs/tiny-cpt.yaml`` (the path in a checkout,
    absent after ``pip install``) all name the shipped ``tiny-cpt.yaml``.
    """
    path = Path(name)
    if path.is_file():
        return path
    shipped = shipped_configs()
    stem = path.name.removesuffix(".yaml")
    in_package_folder = path.parent == Path(".") or path.parent.parts[-2:] == ("infir2", "configs")
    if in_package_folder and stem in shipped:
        return shipped[stem]
    raise FileNotFoundError(
        f"run config {name} does not exist: neither a file nor a shipped config "
        f"({', '.join(shipped)}; `infir2 config --list`)"
    )


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML run config (a file, or a shipped one by name), apply ``--set`` overrides, validate.

    Errors name the key and the file."""
    path = resolve_config_path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of sections (run, model, data, ...)")
    source = str(path)
    if overrides:
        data = apply_overrides(data, overrides, f"{path} with --set")
        source = f"{path} with --set {' '.join(overrides)}"
    return parse_config(data, source)


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain YAML-ready data (tuples as lists)."""
    return to_plain(cfg)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config (every field, defaults included) as YAML; it loads back unchanged."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def key_reference() -> list[tuple[str, Any, str]]:
    """Every config key as ``(dotted key, default, meaning)``, in the order of the sections."""
    cfg = RunConfig()
    defaults = config_to_dict(cfg)
    return [
        (f"{section.name}.{f.name}", defaults[section.name][f.name], f.metadata.get("help", ""))
        for section in fields(cfg)
        for f in fields(getattr(cfg, section.name))
    ]
