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
              oversample_prompts, max_rounds, carry_over, max_new_tokens, temperature, batch_size, rescore,
              exact
    algo:     reward, clip_low, clip_high, kl_coef, tis (auto|truncate|mask|off), tis_cap,
              tis_level (token|sequence|geometric), geo_mask,
              overlong (none|mask|penalty), overlong_buffer, overlong_penalty, updates_per_batch,
              micro_batch_size, adv_eps, routing_replay (off|rollout)
    train:    max_steps, save_every, keep_last, log_every, eval_every, max_skipped_in_row (as in `infir2 train`),
              eval_problems, eval_samples, max_prob_error
    parallel: context                                          (as in `infir2 train`: processes per sequence)
    engine:   rollout.engine's own settings, declared by the engine (its registry entry's settings type:
              rollout.engine: vllm takes tensor_parallel_size, memory_fraction, ... of generation.VllmSettings;
              the builtin engine has none); `infir2 config --keys --stage rl` lists each engine's
    guard:    max_val_drop, max_kl, stop                       (the collapse guard, rl/guard.py)

The run, model, fp8, optim and parallel sections, the keys ``train`` shares (``TrainSection``), their rules,
the YAML reader and ``run.accept_config_changes`` are the run harness's (``infir2.harness.config``), shared
with ``infir2 train``. Validation is strict (an unknown key or a bad value is a ``ValueError`` naming the
dotted key and the file); ``--set key=value`` overrides use the same dotted keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..generation import (
    ENGINES,
    SAME_RECIPE,
    BuiltinSettings,
    EngineOptions,
    check_engine,
    knobs,
    preflight_engine,
)
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
    settings_section,
)
from ..harness.typed_yaml import build, config_error
from ..tasks import GRADERS, TASKS
from .sections import AlgoConfig, RolloutConfig

__all__ = [
    "MEANINGFUL",
    "AlgoConfig",
    "RLConfig",
    "RLData",
    "RLGuard",
    "RLTrain",
    "RolloutConfig",
    "keeps_reference",
    "load_rl_config",
    "parse_rl_config",
    "rollout_engines",
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
    guard: RLGuard = field(default_factory=RLGuard)
    #: rollout.engine's own settings: an instance of its registry entry's settings type (``generation.ENGINES``),
    #: read from the ``engine`` section by ``parse_rl_config`` (the builtin engine has none)
    engine: Any = field(default_factory=BuiltinSettings)


def tis_mode(cfg: RLConfig) -> str:
    """``truncate`` / ``mask`` / ``off``: ``auto`` truncates when rollout and training quantize differently
    (FP8 rollouts of a bf16 ``base_dtype`` round what the trainer holds in fp32: they differ)."""
    if cfg.algo.tis != "auto":
        return cfg.algo.tis
    same = (cfg.rollout.precision == "fp8") == (cfg.fp8.recipe != "bf16")
    if same and cfg.rollout.precision == "fp8":
        same = cfg.fp8.recipe == SAME_RECIPE[cfg.rollout.scale_encoding] and cfg.rollout.base_dtype == "fp32"
    return "off" if same else "truncate"


def keeps_reference(cfg: RLConfig) -> bool:
    """Whether the run keeps a whole copy of the start model: for the loss's KL (``algo.kl_coef > 0``)
    or the collapse guard's (``guard.max_kl``). The loop builds it by this rule, the planner counts it."""
    return cfg.algo.kl_coef > 0 or cfg.guard.max_kl is not None


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
    _check_correction(cfg, source)
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
    _check_replay(cfg, source)
    _check_engine(cfg, source)


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
    elif cfg.algo.routing_replay == "rollout":
        why = (
            "is not wired with algo.routing_replay: rollout (the exact decode pads its batch, the route "
            "recorder reads it unpadded); the identical pairs route alike under it: set replay off"
        )
    elif cfg.parallel.context > 1:
        why = (
            f"needs parallel.context: 1 (the trainer's forward whole, not split), got {cfg.parallel.context}"
        )
    else:
        return
    raise config_error(source, "rollout.exact", why)


def _check_replay(cfg: RLConfig, source: str) -> None:
    """Routing replay needs an engine that records each token's experts (``EngineTraits.records_routes``:
    the built-in one)."""
    engine = cfg.rollout.engine
    traits = ENGINES[engine].traits
    if cfg.algo.routing_replay == "rollout" and (traits is None or not traits.records_routes):
        why = (
            "infir2's vllm engine does not pass vLLM's routed experts through yet"
            if engine == "vllm"
            else f"the {engine} engine does not report the experts it routed each token to"
        )
        raise config_error(
            source, "algo.routing_replay", f"rollout needs rollout.engine: builtin ({why}); set it to off"
        )


def _check_correction(cfg: RLConfig, source: str) -> None:
    """algo.tis_level, algo.geo_mask and rollout.rescore: in range, and with what they need."""
    a, r = cfg.algo, cfg.rollout
    if a.geo_mask is not None and not 0 < a.geo_mask < 1:
        raise config_error(
            source, "algo.geo_mask", f"the band [1 - b, 1 + b] needs 0 < b < 1 (or null), got {a.geo_mask}"
        )
    if a.tis == "off" and a.tis_level != "token":
        raise config_error(
            source,
            "algo.tis_level",
            f"{a.tis_level} weighs nothing with algo.tis: off (set tis or leave token)",
        )
    entry = ENGINES.get(r.engine)  # an unknown name is _check_names' to refuse
    if r.rescore and entry is not None and entry.settings is not BuiltinSettings:
        raise config_error(
            source,
            "rollout.rescore",
            f"scores with the engine's weights in this process: the builtin engine, not {r.engine!r}",
        )
    if r.rescore and r.carry_over:
        raise config_error(
            source,
            "rollout.rescore",
            "is refused with rollout.carry_over: a carried group was sampled before the last update, and "
            "rescoring it with the engine's new weights would hide that",
        )


def _check_engine(cfg: RLConfig, source: str) -> None:
    """rollout.engine's own checks that need no model (vllm: installed, FP8 on this machine, the dtype it
    serves in), each in one line naming the key."""
    r = cfg.rollout
    options = EngineOptions(
        tokenizer=None,
        precision=r.precision,
        scale_encoding=r.scale_encoding,
        model_precision=cfg.model.precision,
    )
    keys = {"engine": "rollout.engine", "precision": "rollout.precision", "model": "model.path"}
    keys |= {f.name: f"engine.{f.name}" for f in knobs(ENGINES[r.engine].settings)}
    try:
        preflight_engine(r.engine, options, cfg.engine, keys)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def rollout_engines() -> dict[str, list[Any]]:
    """The registered engines RL can roll out on that have settings of their own, each with the fields
    of its ``engine`` section (``generation.knobs``)."""
    return {
        name: knobs(entry.settings)
        for name, entry in ENGINES.items()
        if knobs(entry.settings) and (entry.traits is None or entry.traits.returns_ids)
    }


def _engine_section(data: dict[str, Any], source: str) -> Any:
    """The ``engine`` section as an instance of rollout.engine's settings type (``generation.ENGINES``),
    popped from ``data``; a ``vllm`` section (its name before the engines declared their settings) is
    refused in one line naming the key it is now."""
    rollout = data.get("rollout")
    name = rollout.get("engine", "builtin") if isinstance(rollout, dict) else "builtin"
    old = data.get("vllm")
    if isinstance(old, dict) and old:
        key = next(iter(old))
        raise config_error(
            source,
            f"vllm.{key}",
            f"the vllm engine's settings are now the engine section (engine.{key}), read with "
            f"rollout.engine: vllm; rollout.engine is {name!r}",
        )
    section = data.pop("engine", None)
    if name not in ENGINES:  # said by check_engine, naming the registered engines
        return None
    return settings_section(ENGINES[name].settings, name, section, source)


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
    data = dict(data)
    engine = _engine_section(data, source)
    data.pop("vllm", None)  # empty: nothing to refuse
    cfg = replace(build(RLConfig, data, "", source), engine=engine)
    _check(cfg, source)
    return cfg


def load_rl_config(path: str | Path, overrides: list[str] | None = None) -> RLConfig:
    """Read a YAML RL config (a file, or a shipped one by name: ``qwen2.5-7b-rl``), apply ``--set``
    overrides, validate. Errors name the key and the file."""
    return load_stage_config(resolve_config_path(path), parse_rl_config, overrides)


def save_rl_config(cfg: RLConfig, path: str | Path) -> None:
    """The resolved config (every field) as YAML; it loads back unchanged."""
    save_config(cfg, path)
