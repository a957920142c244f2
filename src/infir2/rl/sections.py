"""The two sections that say how an RL run samples and learns: ``rollout`` (the engine, its precision,
the sampling and dynamic sampling) and ``algo`` (the objective and its corrections), each key declared
once with its default and meaning (``harness.config.setting``). ``rl.config`` holds the whole config,
its cross-section rules and its reading and writing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..harness.config import setting

__all__ = ["AlgoConfig", "RolloutConfig"]


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
    rescore: bool = setting(
        False,
        "the rollout log-probabilities from the trainer's scorer run on the engine's weights after "
        "generating (one more forward), not from the sampler; the builtin engine only",
    )
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
    tis_cap: float = setting(2.0, "cap of the pi_train / pi_rollout ratio at algo.tis_level")
    tis_level: Literal["token", "sequence", "geometric"] = setting(
        "token",
        "what one TIS ratio is taken over: each token's own, or per sequence the product of its token "
        "ratios (sequence) or their geometric mean (geometric), the same weight on all its tokens",
    )
    geo_mask: float | None = setting(
        None,
        "b in (0, 1): drop every sequence whose geometric-mean ratio exp(mean(logp_train - logp_rollout)) "
        "leaves [1 - b, 1 + b] (its tokens weigh 0); null = off",
    )
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
    routing_replay: Literal["off", "rollout"] = setting(
        "off",
        "MoE: rollout = the trainer's old, reference and policy forwards send each token to the experts "
        "the rollout engine chose (R3; builtin engine); off = the trainer's router decides. A dense "
        "model is unchanged either way",
    )
