"""Run configs: YAML files validated into nested dataclasses, with ``--set key=value`` overrides.

A run config has eight sections (every field below, with its default; all hyperparameters of the
InfiR2 recipe, RECIPE.md section 2, can be written down)::

    run:      name, out_dir, seed, device (auto|cpu|cuda)
    model:    path (local HF folder) | from_config ({arch: qwen2|llama, hidden_size, ...}),
              tokenizer, precision (fp32|bf16), activation_checkpointing, export_dtype
    fp8:      recipe (bf16|tensorwise|rowwise|blockwise|blockwise_fp32scale), backend
    data:     kind (cpt|sft), train_path, val_path, seq_len, global_batch_size, micro_batch_size,
              max_tokens_per_micro_batch, max_length, overlong (truncate|drop), epochs, shuffle, seed
    optim:    lr, betas, eps, weight_decay, grad_clip, fused, state_dtype (fp32|bf16)
    schedule: name (wsd|cosine|constant), warmup_steps | warmup_fraction, decay_steps | decay_fraction,
              decay_style (cosine|linear), min_lr | min_lr_ratio
    train:    max_steps, eval_every, eval_batches, eval_fp8, save_every, keep_last, log_every,
              max_nonfinite_in_row, loss_chunk_tokens (auto|0|N)
    load:     path, mode (resume|decay_only|weights_only), reset_step, reset_data, force

Validation is strict: an unknown key, a value of the wrong type or outside its allowed set is a
``ValueError`` naming the dotted key and the file. Numbers written as ``1e-4`` (which PyYAML reads as
a string) are accepted for float fields. Overrides use the same dotted keys and are typed by the
field: ``--set optim.lr=3e-4 --set data.shuffle=false --set optim.betas=[0.9,0.95]``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

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
    "load_config",
    "parse_config",
    "save_config",
]


@dataclass(frozen=True)
class RunSection:
    name: str = "run"
    out_dir: str = "runs"  # the run folder is <out_dir>/<name>
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # local Hugging Face folder (config.json + weights); loaded with local_files_only
    from_config: dict[str, Any] | None = (
        None  # {arch: qwen2|llama, hidden_size: ..., ...}: a seeded new model
    )
    tokenizer: str | None = None  # tokenizer folder; default: `path`
    precision: Literal["fp32", "bf16"] = (
        "bf16"  # autocast dtype of the high-precision parts (masters stay fp32)
    )
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (long contexts)
    export_dtype: Literal["fp32", "bf16"] | None = None  # dtype of the final HF export; default: precision


@dataclass(frozen=True)
class Fp8Config:
    recipe: Literal["bf16", "tensorwise", "rowwise", "blockwise", "blockwise_fp32scale"] = "blockwise"
    backend: str | None = None  # force a GEMM backend (emulated, scaled_mm, ...); default: automatic


@dataclass(frozen=True)
class DataConfig:
    kind: Literal["cpt", "sft"] = "cpt"
    train_path: str = ""  # cpt: token-shard folder (train.bin + meta.json); sft: JSONL file
    val_path: str | None = None  # cpt: same folder (val.bin) by default; sft: a JSONL file
    seq_len: int = 2048  # cpt: window length
    global_batch_size: int = 8  # sequences (cpt) or samples (sft) per optimizer step, all ranks together
    micro_batch_size: int = 1  # cpt: sequences per forward
    max_tokens_per_micro_batch: int | None = (
        None  # sft: token budget per forward (authors' max_tokens_per_gpu)
    )
    max_length: int = 32768  # sft: longest sample
    overlong: Literal["truncate", "drop"] = "truncate"  # sft: what happens to samples over max_length
    epochs: int = 1  # passes over the data (sft); cpt runs are sized by train.max_steps
    shuffle: bool = True
    seed: int | None = None  # data order seed; default: run.seed


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-4  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # on >=2-D weights (incl. embeddings); never on norms or biases
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping
    fused: bool | None = None  # AdamW implementation: None = fused on CUDA, foreach elsewhere
    state_dtype: Literal["fp32", "bf16"] = "fp32"  # AdamW moments' storage (math is fp32): 16 vs 12 B/param


@dataclass(frozen=True)
class ScheduleConfig:
    name: Literal["wsd", "cosine", "constant"] = "wsd"
    warmup_steps: int | None = None
    warmup_fraction: float | None = None  # of the total steps (e.g. 0.05); exclusive with warmup_steps
    decay_steps: int | None = None  # wsd: the last decay_steps decay
    decay_fraction: float | None = None  # wsd: the last fraction of the steps decays
    decay_style: Literal["cosine", "linear"] = "cosine"  # wsd decay shape
    min_lr: float | None = None  # final learning rate
    min_lr_ratio: float | None = None  # final lr as a fraction of optim.lr; exclusive with min_lr


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int | None = None  # optimizer steps; None: as many as the data yields (data.epochs)
    eval_every: int = 0  # 0 = no periodic eval (the last step is still evaluated when val data exists)
    eval_batches: int = 8  # val steps per evaluation
    eval_fp8: bool = False  # evaluate with FP8 GEMMs (default: high precision, as the exported model runs)
    save_every: int = 0  # 0 = only at the end
    keep_last: int = 2
    log_every: int = 1  # steps between progress-bar / stdout updates (metrics.jsonl gets every step)
    max_nonfinite_in_row: int = 3  # consecutive skipped (non-finite) steps that stop the run
    # chunked LM-head loss (train/loss.py): tokens per chunk; 0 = never; auto = 2048 once fp32 logits > 1 GiB
    loss_chunk_tokens: int | Literal["auto"] = "auto"


@dataclass(frozen=True)
class LoadConfig:
    path: str | None = None  # a checkpoint folder (step_XXXXXXXX) to start from
    mode: Literal["resume", "decay_only", "weights_only"] = "resume"
    reset_step: bool = False  # decay_only: restart the step counter at 0 (the new schedule starts fresh)
    reset_data: bool = False  # decay_only: start the data from the beginning instead of where it stopped
    force: bool = False  # use `path` even when the run folder has checkpoints (set by `--load`)


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
# Validation: dict -> dataclass, naming the dotted key and the file on any problem


def _err(source: str, key: str, message: str) -> ValueError:
    return ValueError(f"{source}: {key}: {message}")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check ``value`` against the type annotation ``tp`` (and convert the harmless cases)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise _err(source, key, "must not be null")
        errors: list[ValueError] = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, key, source)
            except ValueError as e:
                errors.append(e)
        raise errors[0] if len(errors) == 1 else _err(source, key, f"bad value {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise _err(source, key, f"got {value!r}, expected one of {', '.join(map(str, allowed))}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, source)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise _err(source, key, f"expected a list of {len(args)} numbers, got {value!r}")
        return tuple(
            _coerce(v, a, f"{key}[{i}]", source) for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    if origin is dict:
        if not isinstance(value, dict):
            raise _err(source, key, f"expected a mapping, got {value!r}")
        return dict(value)
    return _coerce_scalar(value, tp, key, source)


def _coerce_scalar(value: Any, tp: Any, key: str, source: str) -> Any:
    if value is None:
        raise _err(source, key, "must not be null")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise _err(source, key, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise _err(source, key, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads `1e-4` as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise _err(source, key, f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise _err(source, key, f"expected a string, got {value!r}")
    raise TypeError(f"unsupported config field type {tp!r} for {key}")


def _build(cls: Any, data: Any, prefix: str, source: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _err(source, prefix or "<top level>", f"expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            where = f"{prefix}.{key}" if prefix else str(key)
            raise _err(source, where, f"unknown key (known keys: {', '.join(sorted(fields))})")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k, source) for k, v in data.items()}
    return cls(**kwargs)


def _check(cfg: RunConfig, source: str) -> None:
    """Cross-field rules that types alone cannot express."""

    def positive(key: str, value: float | None, allow_zero: bool = False) -> None:
        if value is not None and (value < 0 or (value == 0 and not allow_zero)):
            raise _err(source, key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")

    m, d, o, s, t = cfg.model, cfg.data, cfg.optim, cfg.schedule, cfg.train
    if m.path is not None and m.from_config is not None:
        raise _err(
            source, "model", "give one of model.path (a local HF folder) or model.from_config, not both"
        )
    if m.from_config is not None and m.from_config.get("arch") not in ("qwen2", "llama"):
        raise _err(
            source, "model.from_config.arch", f"expected qwen2 or llama, got {m.from_config.get('arch')!r}"
        )
    if m.from_config is not None and m.tokenizer is None:
        raise _err(source, "model.tokenizer", "a model built from_config needs a tokenizer folder")
    for key in ("seq_len", "global_batch_size", "micro_batch_size", "max_length", "epochs"):
        positive(f"data.{key}", getattr(d, key))
    positive("data.max_tokens_per_micro_batch", d.max_tokens_per_micro_batch)
    positive("optim.lr", o.lr)
    positive("optim.eps", o.eps)
    positive("optim.weight_decay", o.weight_decay, allow_zero=True)
    positive("optim.grad_clip", o.grad_clip, allow_zero=True)
    for i, beta in enumerate(o.betas):
        if not 0 <= beta < 1:
            raise _err(source, f"optim.betas[{i}]", f"must be in [0, 1), got {beta}")
    if s.warmup_steps is not None and s.warmup_fraction is not None:
        raise _err(source, "schedule.warmup_steps", "give warmup_steps or warmup_fraction, not both")
    if s.decay_steps is not None and s.decay_fraction is not None:
        raise _err(source, "schedule.decay_steps", "give decay_steps or decay_fraction, not both")
    if s.min_lr is not None and s.min_lr_ratio is not None:
        raise _err(source, "schedule.min_lr", "give min_lr or min_lr_ratio, not both")
    for key in ("warmup_fraction", "decay_fraction", "min_lr_ratio"):
        value = getattr(s, key)
        if value is not None and not 0 <= value <= 1:
            raise _err(source, f"schedule.{key}", f"must be in [0, 1], got {value}")
    positive("schedule.warmup_steps", s.warmup_steps, allow_zero=True)
    positive("schedule.decay_steps", s.decay_steps, allow_zero=True)
    positive("schedule.min_lr", s.min_lr, allow_zero=True)
    positive("train.max_steps", t.max_steps)
    if t.loss_chunk_tokens != "auto":
        positive("train.loss_chunk_tokens", t.loss_chunk_tokens, allow_zero=True)
    for key in ("eval_every", "save_every"):
        positive(f"train.{key}", getattr(t, key), allow_zero=True)
    for key in ("eval_batches", "keep_last", "log_every", "max_nonfinite_in_row"):
        positive(f"train.{key}", getattr(t, key))
    if cfg.load.mode != "resume" and cfg.load.path is None:
        raise _err(source, "load.path", f"load.mode {cfg.load.mode!r} needs a checkpoint path")


def parse_config(data: dict[str, Any], source: str = "<dict>") -> RunConfig:
    """Validate a nested dict (e.g. parsed YAML) into a ``RunConfig``; ``source`` names it in errors."""
    cfg = _build(RunConfig, data, "", source)
    _check(cfg, source)
    return cfg


def _set_dotted(data: dict[str, Any], key: str, value: Any, source: str) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise _err(source, key, f"{part!r} is not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: list[str], source: str = "--set") -> dict[str, Any]:
    """Apply ``key=value`` strings (values parsed as YAML, then typed by the field on validation)."""
    data = yaml.safe_load(yaml.safe_dump(data)) or {}  # deep copy
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{source}: expected KEY=VALUE (e.g. optim.lr=3e-4), got {item!r}")
        _set_dotted(data, key.strip(), yaml.safe_load(text) if text.strip() else None, source)
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML run config, apply ``--set`` overrides, validate. Errors name the key and the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"run config {path} does not exist")
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
    def plain(x: Any) -> Any:
        if isinstance(x, tuple):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(dataclasses.asdict(cfg))


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config (every field, defaults included) as YAML; it loads back unchanged."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
