"""The config sections every stage shares, their rules, and the one way a stage's YAML is read.

``infir2 train`` (``train.config.RunConfig``) and ``infir2 rl`` (``rl.config.RLConfig``) are dataclasses of
sections; four of them are the same for both and live here::

    run:   name, out_dir, seed, device, accept_config_changes
    model: path | from_config, tokenizer, precision, activation_checkpointing, recompute_mlp, recompute_norm,
           mlp_saved_fp8, export_dtype
    fp8:   recipe, backend, param_gather, weight_cache, stats_every, high_precision_tail
    optim: lr, betas, eps, weight_decay, grad_clip, fused, state_dtype

and ``parallel`` (``context``: processes that share each sequence, for both stages) and ``schedule`` (the
learning-rate schedules of ``harness.optim``; ``infir2 rl`` keeps a constant rate). Each stage's ``train``
section opens with the keys of ``TrainSection``::

    train: max_steps, save_every, keep_last, log_every, eval_every, max_skipped_in_row, (the stage's own)

``check_shared`` holds their rules (one implementation for both stages); ``load_stage_config`` reads a
YAML file into a stage's config (``--set`` overrides, then the stage's own ``parse``). Every field carries
its meaning (``setting``), which ``infir2 config --keys`` prints. The harness takes a stage's config as
a ``StageConfig`` (run, model, fp8, ``run_dir``) and the other shared sections one by one, each the one
here or the stage's subclass of it (``check_shared``, ``harness.resume.restore``).

No release of infir2 has been made, so no key has an older name to read: a renamed key is an unknown key
(CONTRIBUTING.md, "Layouts no release has written").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from ..fp8 import RECIPES, get_recipe
from ..kernels.registry import BACKENDS
from ..model import ARCHS
from .typed_yaml import apply_overrides, build, config_error, load_yaml_file, to_plain

__all__ = [
    "FP32_MAX",
    "MAX_LR",
    "MEANINGFUL",
    "Fp8Config",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RunSection",
    "ScheduleConfig",
    "StageConfig",
    "TrainSection",
    "check_positive",
    "check_shared",
    "check_stage",
    "config_to_dict",
    "key_reference",
    "load_stage_config",
    "resolve_config_path",
    "save_config",
    "setting",
    "settings_section",
    "shipped_configs",
]

#: the keys of the shared sections whose change on resume alters what any stage's run computes (its
#: numerics: ``model.*`` / ``fp8.*`` / ``optim.*``; its data order: ``data.*`` and ``run.seed``); a stage's
#: ``MEANINGFUL`` adds its own (``harness.config_changes``)
MEANINGFUL = ("optim.", "data.", "model.", "fp8.", "run.seed")
#: the largest finite float32: optimizer hyperparameters above it become inf inside fp32 AdamW
FP32_MAX = 3.4028234663852886e38
#: the largest peak learning rate accepted: AdamW's update is about lr per element, so lr > 1 moves every
#: weight by more than its typical size (~0.02) fifty times over in one step
MAX_LR = 1.0

Config = TypeVar("Config")


def setting(default: Any, meaning: str) -> Any:
    """A config field with its default and its meaning (``infir2 config --keys`` prints both)."""
    return field(default=default, metadata={"help": meaning})


@dataclass(frozen=True)
class RunSection:
    name: str = setting("run", "the run folder is <out_dir>/<name>")
    out_dir: str = setting("runs", "parent folder of the run folder")
    seed: int = setting(
        0, "seed of the model init (from_config), dropout and the data order (unless data.seed)"
    )
    device: Literal["auto", "cpu", "cuda"] = setting(
        "auto", "auto: cuda when available (torchrun: one GPU per rank)"
    )
    accept_config_changes: bool = setting(
        False,
        "resume although keys that change the run's meaning differ from the run folder's config.yaml "
        "(`--accept-config-changes`; the old one is kept as config.<step>.yaml)",
    )


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = setting(
        None, "local Hugging Face folder (config.json + weights), loaded without network"
    )
    from_config: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": (
                "a seeded new model instead: {arch: qwen2|llama, hidden_size: ..., num_hidden_layers: ...} "
                "(any field of the architecture's transformers config)"
            )
        },
    )
    tokenizer: str | None = setting(None, "tokenizer folder; default: model.path (required with from_config)")
    precision: Literal["fp32", "bf16", "fp64"] = setting(
        "bf16",
        "autocast dtype of the high-precision parts (masters stay fp32); fp32 on CPUs; fp64: masters, "
        "high-precision parts and the emulated GEMMs' accumulation in float64 (a CPU-independent reference "
        "for tests; slow)",
    )
    activation_checkpointing: bool = setting(
        False, "recompute each decoder layer in backward (long contexts)"
    )
    recompute_mlp: bool = setting(
        True,
        "SwiGLU MLPs keep gate and up outputs and recompute silu in backward (exact; saves 2 [T, I] tensors)",
    )
    recompute_norm: bool = setting(
        True,
        "RMSNorms keep their input and rstd and recompute the normalized output in backward (exact; saves "
        "one [T, H] fp32 tensor per norm)",
    )
    mlp_saved_fp8: bool = setting(
        False,
        "the SwiGLU recompute keeps gate and up outputs in FP8 (E4M3, a scale per 1x128 tile; lossy, in the "
        "gradients only; needs recompute_mlp)",
    )
    export_dtype: Literal["fp32", "bf16"] | None = setting(
        None, "dtype of the final <run>/hf export; default: precision (fp32 for an fp64 run)"
    )
    beyond_context: bool = setting(
        False,
        "allow sequences longer than the model's max_position_embeddings (RoPE extrapolation: a choice "
        "you make on purpose); refused otherwise",
    )


@dataclass(frozen=True)
class Fp8Config:
    recipe: str = setting("blockwise", f"FP8 recipe, one of: {', '.join(RECIPES)} (bf16 = no FP8)")
    backend: str | None = setting(None, "force a GEMM backend (emulated, scaled_mm, ...); default: automatic")
    param_gather: bool | None = setting(
        None,
        "FSDP2: all-gather FP8 linears' weights as FP8 codes (1 byte/element); default (null): on for "
        "the blockwise recipes; only recipes whose fprop and dgrad share the weight blocks can (not rowwise)",
    )
    weight_cache: Literal["layer", "step"] = setting(
        "layer",
        "infir2 train: how long a layer's FP8 weight copy lives: layer (quantized in forward, freed after "
        "that layer's backward; under activation checkpointing one layer's at a time) or step (every layer's "
        "kept for the whole optimizer step, quantized once); the same bytes either way. Not used for a weight "
        "FSDP2 all-gathers as FP8 codes (fp8.param_gather): the gathered copy is the GEMMs'. infir2 rl's "
        "update keeps no cache (as layer)",
    )
    stats_every: int = setting(0, "FP8 numerics telemetry (`infir2 numerics`) every N steps; 0 = off")
    high_precision_tail: float = setting(
        0.0,
        "fraction in [0, 1) of the decoder blocks, the last ones, kept in high precision (rounded up to "
        "whole blocks; lm_head always is); torchtitan keeps 0.15 for 4-bit recipes such as nvfp4",
    )


@dataclass(frozen=True)
class OptimConfig:
    lr: float = setting(1e-4, "peak learning rate of AdamW")
    betas: tuple[float, float] = setting((0.9, 0.95), "AdamW betas")
    eps: float = setting(1e-8, "AdamW eps")
    weight_decay: float = setting(0.1, "on >=2-D weights (incl. embeddings); never on norms or biases")
    grad_clip: float = setting(1.0, "max global grad norm; 0 = no clipping")
    fused: bool | None = setting(None, "AdamW implementation: null = fused on CUDA, foreach elsewhere")
    state_dtype: Literal["fp32", "bf16", "fp8"] = setting(
        "fp32",
        "AdamW moments' storage (math is fp32): 16, 12 or ~10 bytes per parameter with the fp32 master "
        "and gradient; fp8: block-scaled codes of >=2-D parameters' moments (optim.fp8_*)",
    )
    grad_dtype: Literal["fp32", "bf16"] = setting(
        "fp32",
        "gradients' storage: fp32 (autograd's), or bf16 kept per parameter as soon as autograd has it "
        "(2 bytes per parameter instead of 4; micro-batches summed in fp32; one process only)",
    )
    fp8_block: int = setting(128, "state_dtype fp8: elements of a row per fp32 scale of the moments")
    fp8_second_moment: Literal["sqrt_e4m3", "e5m2"] = setting(
        "sqrt_e4m3",
        "state_dtype fp8: the second moment v stored as E4M3 codes of sqrt(v) (on the first moment's "
        "scale) or as E5M2 codes of v",
    )
    fp8_range_expansion: bool = setting(
        False, "state_dtype fp8: COAT's dynamic range expansion (a per-block exponent before rounding)"
    )


@dataclass(frozen=True)
class ScheduleConfig:
    name: Literal["wsd", "cosine", "constant"] = setting(
        "wsd", "learning-rate schedule: warmup-stable-decay, cosine, constant"
    )
    warmup_steps: int | None = setting(None, "linear warmup steps; exclusive with warmup_fraction")
    warmup_fraction: float | None = setting(None, "warmup as a fraction of the total steps (e.g. 0.05)")
    decay_steps: int | None = setting(None, "wsd: the last decay_steps decay; exclusive with decay_fraction")
    decay_fraction: float | None = setting(None, "wsd: the last fraction of the steps decays")
    decay_style: Literal["cosine", "linear"] = setting("cosine", "wsd decay shape")
    min_lr: float | None = setting(None, "final learning rate; exclusive with min_lr_ratio")
    min_lr_ratio: float | None = setting(None, "final learning rate as a fraction of optim.lr")


@dataclass(frozen=True)
class ParallelConfig:
    context: int = setting(
        1,
        "context parallelism: processes that share each sequence (1 = off); the world is data x context, "
        "cpt's seq_len a multiple of context * 128 (other sequences are padded to one)",
    )


@dataclass(frozen=True)
class TrainSection:
    """The ``train`` keys every stage has; a stage's ``train`` section subclasses it with its own."""

    max_steps: int | None = setting(None, "optimizer steps; null: as many as the data yields (data.epochs)")
    save_every: int = setting(0, "steps between checkpoints; 0 = only at the end")
    keep_last: int = setting(2, "checkpoints kept in <run>/checkpoints")
    log_every: int = setting(1, "steps between progress-bar / stdout updates (metrics.jsonl gets every step)")
    eval_every: int = setting(
        0,
        "steps between evaluations; 0 = none (the last step is still evaluated when there is held-out data)",
    )
    max_skipped_in_row: int = setting(
        3,
        "consecutive steps whose update was skipped (a non-finite loss or gradient norm, or the stage's own "
        "guard: train's loss spike, rl's rollout mismatch) that stop the run",
    )


@dataclass(frozen=True)
class StageConfig:
    """The sections every stage's config opens with; a stage's config subclasses it with its own."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name


# --------------------------------------------------------------------------------------------
# Rules


def check_stage(data: Any, source: str, foreign: tuple[str, ...], other: str) -> None:
    """A config of the other stage (a section or dotted key only it has: ``foreign``) is refused naming
    the key and the command that runs it, where the type check would say only "unknown key"."""
    found = [k for k in foreign if _has_key(data, k.split("."))]
    if found:
        raise config_error(
            source,
            found[0],
            f"a key of `{other}` configs, not of this command's: run this config with `{other}`",
        )


def _has_key(data: Any, path: list[str]) -> bool:
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def check_positive(source: str, key: str, value: float | None, allow_zero: bool = False) -> None:
    """``value`` (None passes) is finite, within float32 and ``> 0`` (``>= 0`` with ``allow_zero``)."""
    if value is None:
        return
    if not math.isfinite(value):
        raise config_error(source, key, f"must be a finite number, got {value}")
    if abs(value) > FP32_MAX:
        raise config_error(source, key, f"overflows float32 (max {FP32_MAX:.4g}), got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise config_error(source, key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _check_model(m: ModelConfig, source: str) -> None:
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
    if m.from_config is not None and m.tokenizer is None:
        raise config_error(source, "model.tokenizer", "a model built from_config needs a tokenizer folder")
    if m.mlp_saved_fp8 and not m.recompute_mlp:
        raise config_error(
            source,
            "model.mlp_saved_fp8",
            "keeps the SwiGLU recompute's inputs in FP8: needs model.recompute_mlp",
        )


def _check_fp8(f: Fp8Config, source: str) -> None:
    try:
        get_recipe(f.recipe)
    except ValueError as e:
        raise config_error(source, "fp8.recipe", str(e)) from None
    if f.backend is not None and f.backend not in BACKENDS:
        raise config_error(source, "fp8.backend", f"got {f.backend!r}, expected one of {', '.join(BACKENDS)}")
    check_positive(source, "fp8.stats_every", f.stats_every, allow_zero=True)
    if isinstance(f.high_precision_tail, bool) or not (
        isinstance(f.high_precision_tail, (int, float)) and 0 <= f.high_precision_tail < 1
    ):
        raise config_error(
            source, "fp8.high_precision_tail", f"a fraction in [0, 1), got {f.high_precision_tail!r}"
        )
    if f.stats_every and not RECIPES[f.recipe].has_telemetry:
        raise config_error(
            source,
            "fp8.stats_every",
            f"the FP8 telemetry reads FP8 codes; recipe {f.recipe} has E2M1 (NVFP4) operands: set it to 0",
        )
    if f.param_gather and not RECIPES[f.recipe].gathers_fp8_weight:
        raise config_error(
            source,
            "fp8.param_gather",
            f"recipe {f.recipe} has no FP8 weight that serves both "
            "fprop and dgrad; set fp8.param_gather to false or null",
        )


def _check_optim(o: OptimConfig, source: str) -> None:
    check_positive(source, "optim.lr", o.lr)
    if o.lr > MAX_LR:
        raise config_error(
            source,
            "optim.lr",
            f"{o.lr:g} is above {MAX_LR:g}: no AdamW run uses such a learning "
            "rate (LM pre-training and SFT peak at 1e-5 .. 1e-2); the weights would diverge",
        )
    check_positive(source, "optim.eps", o.eps)
    check_positive(source, "optim.weight_decay", o.weight_decay, allow_zero=True)
    check_positive(source, "optim.grad_clip", o.grad_clip, allow_zero=True)
    for i, beta in enumerate(o.betas):
        if not 0 <= beta < 1:
            raise config_error(source, f"optim.betas[{i}]", f"must be in [0, 1), got {beta}")
    check_positive(source, "optim.fp8_block", o.fp8_block)


def _check_run(r: RunSection, source: str) -> None:
    name = Path(r.name)
    if not r.name.strip() or name.is_absolute() or ".." in name.parts or r.name == ".":
        raise config_error(
            source, "run.name", f"must name a folder inside run.out_dir (relative, no '..'), got {r.name!r}"
        )


def _check_train(t: TrainSection, source: str) -> None:
    for key in ("max_steps", "keep_last", "log_every", "max_skipped_in_row"):
        check_positive(source, f"train.{key}", getattr(t, key))
    for key in ("save_every", "eval_every"):
        check_positive(source, f"train.{key}", getattr(t, key), allow_zero=True)


def check_shared(
    cfg: StageConfig, optim: OptimConfig, train: TrainSection, parallel: ParallelConfig, source: str
) -> None:
    """The rules of the shared sections of any stage's config: ``cfg.run``, ``cfg.model``, ``cfg.fp8``, and
    the stage's ``optim``, ``train`` (its ``TrainSection`` keys) and ``parallel``. These three are not
    ``StageConfig`` fields: a stage declares each after its own sections (the order of its YAML), of its
    own subclass (``RLOptim``, ``TrainConfig``, ``RLTrain``)."""
    _check_run(cfg.run, source)
    _check_model(cfg.model, source)
    _check_fp8(cfg.fp8, source)
    _check_optim(optim, source)
    _check_train(train, source)
    check_positive(source, "parallel.context", parallel.context)


# --------------------------------------------------------------------------------------------
# Reading and writing


def load_stage_config(
    path: Path, parse: Callable[[dict[str, Any], str], Config], overrides: list[str] | None = None
) -> Config:
    """Read a YAML config of one stage, apply ``--set`` overrides, validate with ``parse(data, source)``.
    Errors name the key and the file."""
    data = load_yaml_file(path)
    if data is None:
        raise ValueError(f"{path}: empty file (expected a mapping of sections: run, model, data, ...)")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of sections (run, model, data, ...)")
    source = str(path)
    if overrides:
        data = apply_overrides(data, overrides, f"{path} with --set")
        source = f"{path} with --set {' '.join(overrides)}"
    return parse(data, source)


def config_to_dict(cfg: StageConfig) -> dict[str, Any]:
    """A stage's config as plain YAML-ready data (tuples as lists)."""
    return to_plain(cfg)


def save_config(cfg: StageConfig, path: str | Path) -> None:
    """Write the resolved config (every field, defaults included) as YAML; it loads back unchanged."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def settings_section(kind: type | None, engine: str, section: Any, source: str, key: str = "engine") -> Any:
    """The ``engine`` section of a stage's config (``section``, parsed YAML) as an instance of ``kind``:
    the settings type an engine's registry entry declares, each field with its meaning
    (``generation.knob``). An engine without such settings (None, no fields, or fields its caller sets)
    takes an empty section only. Errors name ``key.FIELD`` and ``source``."""
    declared = kind is not None and fields(kind) and all("help" in f.metadata for f in fields(kind))
    if not declared:
        if section:
            where = f"{key}.{next(iter(section))}" if isinstance(section, dict) else key
            raise config_error(source, where, f"the {engine} engine has no settings of its own")
        return kind() if kind is not None and not fields(kind) else None
    try:
        return build(kind, section, key, source)
    except ValueError as e:  # the settings' own range checks name their field, not the file
        raise e if str(e).startswith(source) else config_error(source, key, str(e)) from None


def key_reference(cfg: StageConfig) -> list[tuple[str, Any, str]]:
    """Every key of a stage's config ``cfg`` (its defaults) as ``(dotted key, default, meaning)``."""
    defaults = config_to_dict(cfg)
    return [
        (f"{section.name}.{f.name}", defaults[section.name][f.name], f.metadata.get("help", ""))
        for section in fields(cfg)
        for f in fields(getattr(cfg, section.name))
    ]


def shipped_configs() -> dict[str, Path]:
    """The run configs installed with the package (``infir2/configs/*.yaml``), by name (no ``.yaml``)."""
    folder = Path(str(resources.files("infir2") / "configs"))
    return {path.stem: path for path in sorted(folder.glob("*.yaml"))}


def resolve_config_path(name: str | Path) -> Path:
    """A run config file of any stage: ``name`` if it is a file, else the shipped config of that name.

    ``tiny-cpt``, ``tiny-cpt.yaml`` and ``src/infir2/configs/tiny-cpt.yaml`` (the path in a checkout,
    absent after ``pip install``) all name the shipped ``tiny-cpt.yaml``.
    """
    path = Path(name)
    if path.is_file():
        return path
    if path.is_dir():
        raise ValueError(f"run config {name} is a folder, not a YAML file")
    shipped = shipped_configs()
    stem = path.name.removesuffix(".yaml")
    in_package_folder = path.parent == Path(".") or path.parent.parts[-2:] == ("infir2", "configs")
    if in_package_folder and stem in shipped:
        return shipped[stem]
    raise FileNotFoundError(
        f"run config {name} does not exist: neither a file nor a shipped config "
        f"({', '.join(shipped)}; `infir2 config --list`)"
    )
