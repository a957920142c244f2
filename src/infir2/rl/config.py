"""RL run configs: YAML validated into nested dataclasses, the same system as ``infir2 train``'s.

Sections (every field below, with its default; the defaults are the InfiR2 authors' RL settings
where they published one, docs/RL.md)::

    run:      name, out_dir, seed, device                      (as in `infir2 train`)
    model:    path | from_config, tokenizer, precision, ...    (as in `infir2 train`)
    fp8:      recipe, backend, ...                             (the *training* precision, as in `infir2 train`)
    optim:    lr 1e-6, betas (0.9, 0.98), eps, weight_decay 0.1, grad_clip 1.0   (constant lr)
    data:     task (a task of infir2.tasks.TASKS: the JSONL schema, default math), prompts_path, val_path,
              shuffle, seed
    rollout:  engine (a name in infir2.generation.ENGINES), precision (high|fp8), scale_encoding (pow2|fp32),
              base_dtype (bf16|fp32), prompts_per_step, group_size,
              oversample_prompts, max_rounds, carry_over, max_new_tokens, temperature, batch_size, exact
    algo:     reward, clip_low, clip_high, kl_coef, tis (auto|truncate|mask|off), tis_cap,
              overlong (none|mask|penalty), overlong_buffer, overlong_penalty, updates_per_batch,
              micro_batch_size, adv_eps
    train:    max_steps, save_every, keep_last, log_every, eval_every, max_skipped_in_row (as in `infir2 train`),
              eval_problems, eval_samples, max_prob_error
    parallel: context                                          (as in `infir2 train`: processes per sequence)
    vllm:     tensor_parallel_size, memory_fraction, cpu_kv_cache_gib, max_model_len, enforce_eager, dtype
              (the settings of rollout.engine: vllm, generation.VllmSettings; refused with another engine)
    guard:    max_val_drop, max_kl, stop                       (the collapse guard, rl/guard.py)

The run, model, fp8, optim and parallel sections, the keys ``train`` shares (``TrainSection``), their rules,
the YAML reader and ``run.accept_config_changes`` are the run harness's (``infir2.harness.config``), shared
with ``infir2 train``. Validation is strict (an unknown key or a bad value is a ``ValueError`` naming the
dotted key and the file); ``--set key=value`` overrides use the same dotted keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from ..generation import SAME_RECIPE, check_engine
from ..harness.config import MEANINGFUL as SHARED_MEANINGFUL
from ..harness.config import (
    OptimConfig,
    ParallelConfig,
    StageConfig,
    TrainSection,
    check_positive,
    check_shared,
    check_stage,
    load_stage_config,
    resolve_config_path,
    save_config,
    setting,
)
from ..harness.typed_yaml import build, config_error
from ..tasks import GRADERS, TASKS

__all__ = [
    "MEANINGFUL",
    "AlgoConfig",
    "RLConfig",
    "RLData",
    "RLGuard",
    "RLTrain",
    "RolloutConfig",
    "load_rl_config",
    "parse_rl_config",
    "save_rl_config",
    "tis_mode",
]


#: the shared sections' meaningful keys, how an RL run samples and learns, and what its held-out accuracy
#: (the collapse guard's start, saved in guard.json) measures
MEANINGFUL = (*SHARED_MEANINGFUL, "rollout.", "algo.", "train.eval_samples")


@dataclass(frozen=True)
class RLOptim(OptimConfig):
    lr: float = setting(1e-6, "AdamW learning rate, constant (the authors' RL value)")
    betas: tuple[float, float] = setting((0.9, 0.98), "AdamW betas")
    weight_decay: float = setting(0.1, "on >=2-D weights (incl. embeddings); never on norms or biases")


@dataclass(frozen=True)
class RLData:
    task: str = setting(
        "math", "the prompts' task (infir2.tasks.TASKS): their JSONL schema and default grader"
    )
    prompts_path: str = setting("", "JSONL of data.task's schema (what `infir2 eval --task TASK` reads)")
    val_path: str | None = setting(
        None, "held-out problems, scored every train.eval_every steps (greedy, or train.eval_samples)"
    )
    shuffle: bool = setting(True, "a new prompt order every pass over the file")
    seed: int | None = setting(None, "prompt-order seed; null: run.seed")


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = setting("builtin", "a name in infir2.generation.ENGINES (builtin: in-process, KV cache)")
    precision: Literal["high", "fp8"] = setting(
        "fp8",
        "the projections' GEMMs while generating (generation.PRECISIONS): fp8 = the FP8 export's 128x128 "
        "weights + 1x128 activations; high = no FP8, the run's high precision (its dtype: model.precision)",
    )
    scale_encoding: Literal["pow2", "fp32"] = setting(
        "pow2", "fp8 block scales, as `infir2 export --scale-encoding`"
    )
    base_dtype: Literal["bf16", "fp32"] = setting(
        "bf16",
        "fp8: the embeddings, norms and lm_head as the FP8 export stores them (`infir2 export --base-dtype`): "
        "rollouts are the deployed model; fp32: the trainer's values (the identical pair)",
    )
    prompts_per_step: int = setting(128, "groups trained on per step")
    group_size: int = setting(16, "samples per prompt")
    oversample_prompts: int | None = setting(
        384, "prompts drawn per generation round (dynamic sampling); null: prompts_per_step"
    )
    max_rounds: int = setting(4, "generation rounds per step before training on fewer groups")
    carry_over: bool = setting(
        False, "keep valid groups beyond prompts_per_step for the next step (else drop them)"
    )
    max_new_tokens: int = setting(8192, "response budget per sample, in tokens")
    temperature: float = setting(1.0, "sampling temperature (the log-probabilities are of this distribution)")
    batch_size: int = setting(64, "sequences generated together (the KV cache holds this many)")
    exact: bool = setting(
        False,
        "builtin engine: decode with exact numerics (the trainer's forward and the KV-cached decode compute "
        "each token's logits bit for bit alike; fp32, CPU, one thread; docs/RL.md)",
    )


@dataclass(frozen=True)
class AlgoConfig:
    reward: str = setting(
        "math", "a grader of infir2.tasks.GRADERS (1.0 correct, else 0.0): data.task's, or a registered one"
    )
    dynamic_sampling: bool = setting(True, "drop groups whose rewards all agree and refill (DAPO)")
    clip_low: float = setting(0.2, "the ratio is clipped to [1 - clip_low, 1 + clip_high] (clip-higher)")
    clip_high: float = setting(0.28, "upper clip of the ratio (DAPO's clip-higher)")
    kl_coef: float = setting(
        0.0, "k3 KL to the initial model in the loss; 0 = only logged (no reference kept)"
    )
    tis: Literal["auto", "truncate", "mask", "off"] = setting(
        "auto", "truncated importance sampling; auto: truncate when rollout and training precisions differ"
    )
    tis_cap: float = setting(2.0, "per-token pi_train / pi_rollout cap")
    overlong: Literal["none", "mask", "penalty"] = setting(
        "mask", "truncated responses: no loss (mask), or a length penalty"
    )
    overlong_buffer: int = setting(
        0, "penalty: the last N tokens before max_new_tokens are penalised linearly"
    )
    overlong_penalty: float = setting(1.0, "penalty at max_new_tokens")
    updates_per_batch: int = setting(1, "optimizer steps per rollout batch (mini-batches; > 1 is off-policy)")
    micro_batch_size: int = setting(16, "sequences per forward/backward")
    adv_eps: float = setting(1e-6, "advantage = (r - mean) / (std + adv_eps) within the group")


@dataclass(frozen=True)
class RLTrain(TrainSection):
    max_steps: int = setting(100, "RL steps (rollout batches)")
    eval_problems: int | None = setting(
        None, "held-out accuracy on the first N of data.val_path at each evaluation; null: all"
    )
    eval_samples: int | None = setting(
        None,
        "held-out accuracy: null = greedy (one response per problem); k = the mean reward of k responses "
        "per problem sampled at rollout.temperature (avg@k: the quantity RL raises), the same seeds at "
        "every evaluation",
    )
    max_prob_error: float | None = setting(
        1.5,
        "skip a step's updates when its rollout / training mismatch (NeMo-RL's token probability error, "
        "mean exp|logp_train - logp_rollout|; healthy: < 1.03-1.05) is above this; null = off",
    )


@dataclass(frozen=True)
class RLVllm:
    """``rollout.engine: vllm``'s own settings (``generation.vllm_engine.VllmSettings``)."""

    tensor_parallel_size: int = setting(1, "GPUs vLLM splits the model over")
    memory_fraction: float = setting(
        0.5, "GPU memory vLLM takes (gpu_memory_utilization); colocated: leave the trainer room"
    )
    cpu_kv_cache_gib: float = setting(1.0, "CPU: the KV cache in GiB (VLLM_CPU_KVCACHE_SPACE, when unset)")
    max_model_len: int | None = setting(None, "null: the model's max_position_embeddings")
    enforce_eager: bool = setting(True, "no CUDA graphs (start in seconds); false: faster decoding on GPU")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto",
        "what vLLM computes in; auto: as the builtin engine's rollouts (model.precision's dtype; bfloat16 "
        "for rollout.precision fp8, whose activations vLLM takes in bf16)",
    )

    def settings(self) -> Any:
        from ..generation.vllm_engine import VllmSettings

        return VllmSettings(**{f: getattr(self, f) for f in self.__dataclass_fields__})


@dataclass(frozen=True)
class RLGuard:
    """The collapse guard (``rl/guard.py``): a warning, or with ``stop`` the end of the run."""

    max_val_drop: float | None = setting(
        0.05,
        "held-out accuracy (data.val_path, greedy or train.eval_samples; measured before step 1 and at "
        "every evaluation) more than this below the start's (a fraction: 0.05 = 5 points); null = off",
    )
    max_kl: float | None = setting(
        None,
        "mean per-token k3 KL of the policy to the start model above this (keeps a reference copy, as "
        "algo.kl_coef > 0 does, and logs kl_ref every step); null = off",
    )
    stop: bool = setting(
        False, "stop at the first trip; hf/ then holds the weights of the best held-out accuracy"
    )


@dataclass(frozen=True)
class RLConfig(StageConfig):
    optim: RLOptim = field(default_factory=RLOptim)
    data: RLData = field(default_factory=RLData)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: RLTrain = field(default_factory=RLTrain)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # context: scoring and update only
    vllm: RLVllm = field(default_factory=RLVllm)
    guard: RLGuard = field(default_factory=RLGuard)


def tis_mode(cfg: RLConfig) -> str:
    """``truncate`` / ``mask`` / ``off``: ``auto`` truncates when rollout and training quantize differently
    (FP8 rollouts of a bf16 ``base_dtype`` round what the trainer holds in fp32: they differ)."""
    if cfg.algo.tis != "auto":
        return cfg.algo.tis
    same = (cfg.rollout.precision == "fp8") == (cfg.fp8.recipe != "bf16")
    if same and cfg.rollout.precision == "fp8":
        same = cfg.fp8.recipe == SAME_RECIPE[cfg.rollout.scale_encoding] and cfg.rollout.base_dtype == "fp32"
    return "off" if same else "truncate"


def _check(cfg: RLConfig, source: str) -> None:
    check_shared(cfg, cfg.optim, cfg.train, cfg.parallel, source)  # as `infir2 train` checks them
    r, a, t = cfg.rollout, cfg.algo, cfg.train

    def positive(key: str, value: float | None, allow_zero: bool = False) -> None:
        check_positive(source, key, value, allow_zero)

    for key in (
        "prompts_per_step",
        "group_size",
        "oversample_prompts",
        "max_rounds",
        "max_new_tokens",
        "temperature",
        "batch_size",
    ):
        positive(f"rollout.{key}", getattr(r, key))
    if r.oversample_prompts is not None and r.oversample_prompts < r.prompts_per_step:
        raise config_error(
            source,
            "rollout.oversample_prompts",
            f"{r.oversample_prompts} is below rollout.prompts_per_step={r.prompts_per_step}: a round could "
            "never fill a step (draw at least prompts_per_step prompts per round, or null for exactly that)",
        )
    if r.group_size < 2:
        raise config_error(
            source, "rollout.group_size", f"needs >= 2 samples per prompt to compare, got {r.group_size}"
        )
    for key in ("clip_low", "clip_high", "kl_coef", "overlong_penalty", "adv_eps"):
        positive(f"algo.{key}", getattr(a, key), allow_zero=True)
    if a.clip_low >= 1:
        raise config_error(
            source, "algo.clip_low", f"must be < 1 (the ratio floor is 1 - clip_low), got {a.clip_low}"
        )
    positive("algo.tis_cap", a.tis_cap)
    positive("algo.overlong_buffer", a.overlong_buffer, allow_zero=True)
    if a.overlong == "penalty" and not 0 < a.overlong_buffer <= r.max_new_tokens:
        raise config_error(
            source,
            "algo.overlong_buffer",
            f"overlong: penalty needs 0 < overlong_buffer <= rollout.max_new_tokens, got {a.overlong_buffer}",
        )
    positive("algo.updates_per_batch", a.updates_per_batch)
    positive("algo.micro_batch_size", a.micro_batch_size)
    positive("train.eval_problems", t.eval_problems)
    positive("train.eval_samples", t.eval_samples)
    if t.max_prob_error is not None and t.max_prob_error <= 1:
        raise config_error(
            source,
            "train.max_prob_error",
            f"must be > 1 (1 is a perfect match) or null, got {t.max_prob_error}",
        )
    g = cfg.guard
    if g.max_val_drop is not None and not 0 <= g.max_val_drop < 1:
        raise config_error(
            source,
            "guard.max_val_drop",
            f"a fraction in [0, 1) (0.05 = 5 points) or null, got {g.max_val_drop}",
        )
    positive("guard.max_kl", g.max_kl)
    _check_exact(cfg, source)
    _check_names(cfg, source)
    _check_vllm(cfg, source)


def _check_exact(cfg: RLConfig, source: str) -> None:
    """``rollout.exact``: the built-in engine, fp32 math, one process per sequence (what is measured)."""
    if not cfg.rollout.exact:
        return
    if cfg.rollout.engine != "builtin":
        why = f"the built-in engine's decode only; rollout.engine is {cfg.rollout.engine!r}"
    elif cfg.model.precision != "fp32":
        why = (
            f"needs model.precision: fp32 (exact numerics are fp32 CPU kernels), got {cfg.model.precision!r}"
        )
    elif cfg.parallel.context > 1:
        why = (
            f"needs parallel.context: 1 (the trainer's forward whole, not split), got {cfg.parallel.context}"
        )
    else:
        return
    raise config_error(source, "rollout.exact", why)


def _check_vllm(cfg: RLConfig, source: str) -> None:
    """The vllm section: in range, and changed only for rollout.engine: vllm."""
    v = cfg.vllm
    if cfg.rollout.engine != "vllm" and v != RLVllm():
        changed = [f for f in v.__dataclass_fields__ if getattr(v, f) != getattr(RLVllm(), f)]
        raise config_error(
            source,
            f"vllm.{changed[0]}",
            f"sets rollout.engine: vllm's engine, but rollout.engine is {cfg.rollout.engine!r}",
        )
    if cfg.rollout.engine != "vllm":
        return
    from ..generation import vllm_engine as ve

    fp8 = cfg.rollout.precision == "fp8"
    try:
        settings = replace(v.settings(), model_precision=cfg.model.precision)
        ve.require_vllm("rollout.engine")  # installed, before any model is read
        why = ve.fp8_unsupported() if fp8 else None
        if why is not None:
            raise ve.fp8_refusal("rollout.precision", why)
        dtype, why = ve.served_dtype(settings, fp8)
        auto = why if v.dtype == "auto" else ""
        ve.check_served_dtype(dtype, fp8, "vllm.dtype", ve.supported_dtypes(), auto)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _check_names(cfg: RLConfig, source: str) -> None:
    """The registry names: engine, task, reward (and a task's grader that fits its task)."""
    try:  # a registered engine that can roll out at rollout.precision, with token ids
        check_engine(
            cfg.rollout.engine, "rollout.engine", cfg.rollout.precision, "rollout.precision", needs_ids=True
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    for key, value, names in (
        ("data.task", cfg.data.task, TASKS),
        ("algo.reward", cfg.algo.reward, GRADERS),
    ):
        if value not in names:
            raise config_error(source, key, f"got {value!r}, expected one of {', '.join(names)}")
    task, reward = cfg.data.task, cfg.algo.reward
    if reward in TASKS and reward != task:
        raise config_error(
            source,
            "algo.reward",
            f"{reward!r} grades {reward} answers, but data.task is {task!r}: set algo.reward: {task}",
        )


#: rollout.precision's words of before one vocabulary (``generation.PRECISIONS``), and what each is now
_OLD_PRECISIONS = {"bf16": "high"}


def _refuse_old_precision(data: dict[str, Any], source: str) -> None:
    """An old ``rollout.precision`` word, in one line: the key, the file, the words, what it means now."""
    rollout = data.get("rollout")
    old = rollout.get("precision") if isinstance(rollout, dict) else None
    if isinstance(old, str) and old in _OLD_PRECISIONS:
        raise config_error(
            source,
            "rollout.precision",
            f"got {old!r}, expected high or fp8 ({old} named the run's high precision, model.precision, "
            f"whatever its dtype: it is now rollout.precision: {_OLD_PRECISIONS[old]})",
        )


def parse_rl_config(data: dict[str, Any], source: str = "<dict>") -> RLConfig:
    """Validate a nested dict (parsed YAML) into an ``RLConfig``; ``source`` names it in errors."""
    _refuse_old_precision(data, source)
    check_stage(
        data, source, ("schedule", "load", "data.train_path", "data.kind"), "infir2 train"
    )  # sections RLConfig has not
    cfg = build(RLConfig, data, "", source)
    _check(cfg, source)
    return cfg


def load_rl_config(path: str | Path, overrides: list[str] | None = None) -> RLConfig:
    """Read a YAML RL config (a file, or a shipped one by name: ``qwen2.5-7b-rl``), apply ``--set``
    overrides, validate. Errors name the key and the file."""
    return load_stage_config(resolve_config_path(path), parse_rl_config, overrides)


def save_rl_config(cfg: RLConfig, path: str | Path) -> None:
    """The resolved config (every field) as YAML; it loads back unchanged."""
    save_config(cfg, path)
