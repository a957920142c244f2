"""The RL term: one step of an RL config (``plan_rl``), and the check ``infir2 rl`` makes before it loads.

Besides the update's training plan (``dense.plan_step`` over ``algo.micro_batch_size`` sequences of
the prompt + ``rollout.max_new_tokens`` tokens, its logits those of the chunked token scorer) a step
keeps:

* reference    the KL reference (``algo.kl_coef > 0``): a whole fp32 copy of the model on every rank
* engine       the rollout engine's copy (``rollout.precision: fp8``: the FP8 export's projections, 1 byte
               per weight + a 128x128 block's fp32 scale, the rest fp32; ``bf16``: a whole fp32 copy)
* kv cache     ``rollout.batch_size`` x (prompt + ``max_new_tokens``) keys and values of every layer (bf16
               on GPUs, fp32 on CPUs), plus one layer's more while it grows
* scoring      the no-grad scoring of one micro-batch: its final hidden states and two ``[chunk, V]`` fp32
               blocks of the token scorer (``loss.scorer.chunk_tokens_for``, the 256 MiB budget)
* context      ``parallel.context`` N: the update and the scoring hold ``seq / N`` tokens of each sequence
               and the keys and values gathered from the other shards; the rollout's KV cache is whole

The three phases peak apart (rollout: the weights, optimizer state and KV cache; scoring; the update:
the training plan), over the resident weights, the reference and the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..fp8.formats import BLOCK
from ..fp8.recipe import Cast
from ..loss.scorer import chunk_tokens_for
from .context import context_kv_bytes
from .dense import Plan, plan_step
from .inputs import BF16_BYTES, FP32_BYTES, PlanInputs
from .quantized import layer_weight_bytes
from .shape import ModelShape

__all__ = ["RLPlan", "peak_phase", "plan_rl", "rl_context"]

#: the rollout engine's FP8 weights (the FP8 export's): 128x128 blocks, a 4-byte scale each
SERVING = Cast((BLOCK, BLOCK), scale_encoding="fp32")


@dataclass
class RLPlan:
    """Bytes per GPU of one RL step: the update's training plan, and what RL keeps besides (module doc)."""

    update: Plan  # the policy: weights, gradients, optimizer, activations and logits of one micro-batch
    reference: float  # the KL reference's whole copy (0 without algo.kl_coef)
    engine: float  # the rollout engine's copy of the weights
    kv_cache: float  # the rollout's keys and values (and one layer's more while the cache grows)
    rollout_logits: float  # the sampler's [batch_size, V] logits, log-softmax and probabilities (fp32)
    scoring: float  # the no-grad scoring of one micro-batch: hidden states + two [chunk, V] blocks

    @property
    def resident(self) -> float:
        """Held through the whole step: sharded weights and optimizer state, the reference, the engine."""
        return self.update.parameters + self.update.optimizer + self.reference + self.engine

    @property
    def rollout_peak(self) -> float:
        return self.resident + self.kv_cache + self.rollout_logits

    @property
    def scoring_peak(self) -> float:
        return self.resident + self.update.gathered / 2 + self.scoring  # the weights gathered, no gradients

    @property
    def update_peak(self) -> float:
        return self.update.peak + self.reference + self.engine

    @property
    def peak(self) -> float:
        return max(self.rollout_peak, self.scoring_peak, self.update_peak)


def peak_phase(p: RLPlan) -> str:
    """The phase whose peak is the step's: the rollout, the scoring or the update."""
    return max(
        (p.rollout_peak, "the rollout"), (p.scoring_peak, "the scoring"), (p.update_peak, "the update")
    )[1]


def rl_context(cfg: Any) -> int:
    """The config's context-parallel degree (``parallel.context``; 1 where the config has none)."""
    return int(getattr(getattr(cfg, "parallel", None), "context", 1) or 1)


def plan_rl(
    shape: ModelShape, cfg: Any, gpus: int = 1, prompt_len: int = 512, device: str = "cuda"
) -> RLPlan:
    """The memory of one RL step of ``cfg`` (an ``RLConfig``) on one of ``gpus`` GPUs (FSDP2), or one CPU
    process (``device="cpu"``), for prompts of ``prompt_len`` tokens.

    With ``parallel.context`` N (``gpus`` is data x N) the update and the scoring keep the activations
    and logits of ``seq / N`` tokens of each sequence plus the keys and values gathered from the other
    shards (``context.context_kv_bytes``); the rollout's KV cache is not split (each rank generates
    whole sequences)."""
    cpu, context = device == "cpu", rl_context(cfg)
    seq = prompt_len + cfg.rollout.max_new_tokens
    micro = cfg.algo.micro_batch_size
    update = plan_step(
        shape,
        PlanInputs(
            cfg.fp8.recipe,
            gpus=gpus,
            seq_len=seq,
            micro_batch=micro,
            activation_checkpointing=cfg.model.activation_checkpointing,
            state_dtype=cfg.optim.state_dtype,
            state_block=cfg.optim.fp8_block,
            state_expand=cfg.optim.fp8_range_expansion,
            grad_dtype=cfg.optim.grad_dtype,
            loss_chunk_tokens="auto",
            recompute_mlp=cfg.model.recompute_mlp,
            recompute_norm=cfg.model.recompute_norm,
            mlp_saved_fp8=cfg.model.mlp_saved_fp8,
            precision=cfg.model.precision if cfg.model.precision != "fp64" else "fp32",
            device=device,
            context=context,
        ),
    )
    whole = FP32_BYTES * shape.params
    if cfg.rollout.precision == "fp8":  # ServingFp8Linear: FP8 codes + one fp32 scale per 128x128 block
        proj = shape.projection_weights * shape.layers
        engine = shape.layers * layer_weight_bytes(shape, SERVING) + (shape.params - proj) * FP32_BYTES
    else:
        engine = whole
    kv_dtype = FP32_BYTES if cpu else BF16_BYTES
    per_layer = 2 * shape.kv_heads * shape.head_dim * kv_dtype * cfg.rollout.batch_size * seq
    responses = micro * cfg.rollout.max_new_tokens // context  # this rank's share of the scored tokens
    chunk = chunk_tokens_for("auto", responses, shape.vocab)
    block = min(chunk or responses, responses) * shape.vocab * FP32_BYTES
    # no grad: one layer's gathered keys and values at a time
    scored = micro * seq // context * shape.hidden * FP32_BYTES + context_kv_bytes(
        shape, micro * seq, context, cpu
    )
    return RLPlan(
        update=update,
        reference=whole if cfg.algo.kl_coef > 0 else 0.0,
        engine=engine,
        kv_cache=per_layer * (shape.layers + 1),
        rollout_logits=3 * cfg.rollout.batch_size * shape.vocab * FP32_BYTES,
        scoring=scored + 2 * block,
    )
