"""The training step's terms, per GPU (or per CPU process): ``plan(shape, recipe, **settings)``.

* parameters   fp32 masters, FSDP-sharded: ``4 P / gpus``; gradients the same (bf16 on one GPU:
               ``2 P`` and the largest parameter's fp32 gradient as it arrives; one process accumulating
               micro-batches: the arriving gradient beside the stored ones; ``planning.optimizer``)
* optimizer    AdamW moments: ``8 P / gpus`` (``state_dtype="fp32"``), ``4 P / gpus`` (``bf16``) or about
               ``2.06 P / gpus`` (``fp8``; ``planning.optimizer``)
* gathered     FSDP2 working copies (gpus > 1): the root module's parameters (final norm, lm_head; a tied
               embedding) plus two decoder layers (the current one and the prefetched next), and their
               unsharded gradients; an untied embedding is a unit of its own, gathered only in its passes
* weight copies what each layer's GEMMs keep for backward (``layer.layer_figures``): autocast's bf16
               copies and the FP8 copies alike live until the layer's backward (every layer's, one under
               activation checkpointing); with ``weight_cache="step"`` every layer's FP8 copy (and on CUDA
               its K-major transpose) for the whole step; none where the gathered weight is the GEMMs'
* activations  per-layer bytes per token times tokens times layers; with activation checkpointing each
               layer's fp32 input plus one layer's full set; plus the final norm and the context term
* logits       plain loss: the fp32 log-softmax (4 T V) and, in backward, its and the logits' gradients
               (8 T V); chunked: one ``[chunk, V]`` fp32 block (1.5 under bf16: the bf16 logits beside it)
* optimizer step  AdamW's temporaries during its step, when the activations are gone (``planning.optimizer``)
* all-gather   bytes each GPU receives per optimizer step; reduce-scatter of fp32 gradients
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..fp8 import RECIPES
from ..loss.scorer import chunk_tokens_for
from .context import gathered_kv_bytes
from .inputs import BF16_BYTES, FP32_BYTES, PlanInputs
from .layer import layer_figures
from .optimizer import arriving_gradient_bytes, gradient_bytes, moment_bytes, optimizer_step_bytes
from .quantized import layer_weight_bytes
from .shape import ModelShape

__all__ = ["Plan", "plan", "plan_step"]

PLAIN_LOGITS_SAVED, PLAIN_LOGITS_BACKWARD = 4, 8  # bytes per logit: fp32 log-softmax; its + the logits' grads


@dataclass(frozen=True)
class Plan:
    """Bytes per GPU (``all_gather``/``reduce_scatter``: bytes received/sent per optimizer step)."""

    parameters: float
    gradients: float
    optimizer: float
    gathered: float
    weight_copies: float
    activations: float
    logits_saved: float
    logits_backward: float
    all_gather: float
    reduce_scatter: float
    optimizer_step: float = 0.0  # AdamW's temporaries during its step (activations are gone by then)
    arriving: float = 0.0  # of ``gradients``: the fp32 gradient autograd hands over, gone by the step

    @property
    def backward_peak(self) -> float:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.gathered
            + self.weight_copies
            + self.activations
            + self.logits_saved
            + self.logits_backward
        )

    @property
    def step_peak(self) -> float:
        return self.parameters + self.gradients - self.arriving + self.optimizer + self.optimizer_step

    @property
    def peak(self) -> float:
        """The larger of the start of backward and the optimizer step."""
        return max(self.backward_peak, self.step_peak)


def plan(shape: ModelShape, recipe: str, **settings: Any) -> Plan:
    """The memory and traffic of one GPU for ``recipe`` and the run ``settings`` (``PlanInputs``'s fields)."""
    return plan_step(shape, PlanInputs(recipe, **settings))


def plan_step(shape: ModelShape, run: PlanInputs) -> Plan:
    """The memory and traffic of one GPU (a CPU process with ``device="cpu"``) of the run ``run``.

    Under FSDP (``gpus > 1``) parameters travel in ``precision`` (bf16 mixed precision, or fp32), and
    an FP8 recipe's projection weights as FP8 codes when ``param_gather`` (default: as
    ``fp8.param_gather``, on for the block-scaled recipes); the gathered weight is then the GEMMs' copy,
    so no other weight copy is kept. A CPU run: no bf16 weight or lm_head copies, fp32 activations, and
    an FP8 recipe's weight copies are its FP8 codes and scales (no K-major transpose).
    """
    per_token, weight_copy = layer_figures(
        shape, run.recipe, run.recompute_mlp, run.device, run.recompute_norm, run.mlp_saved_fp8
    )
    p, shard = shape.params, 1 / run.gpus
    saved, backward = _logits(shape, run)
    gathered, weight_copies, gather = _weights(shape, run, weight_copy)
    micro_steps = run.micro_steps
    return Plan(
        parameters=FP32_BYTES * p * shard,
        gradients=gradient_bytes(shape, run) * shard,
        arriving=arriving_gradient_bytes(shape, run) * shard,
        optimizer=moment_bytes(shape, run) * shard,
        gathered=gathered,
        weight_copies=weight_copies,
        activations=_activations(shape, run, per_token),
        logits_saved=saved,
        logits_backward=backward,
        all_gather=gather * micro_steps,
        reduce_scatter=FP32_BYTES * p * (1 - shard) * micro_steps,
        optimizer_step=optimizer_step_bytes(shape, run) * shard,
    )


def _activations(shape: ModelShape, run: PlanInputs, per_token: float) -> float:
    """The layers' saved tensors (checkpointed: each layer's fp32 input and one layer's full set), the
    final norm's input and output, the token ids, rotary cos / sin, and the context term."""
    tokens = run.tokens
    if run.activation_checkpointing:
        activations = tokens * (shape.layers * shape.hidden * FP32_BYTES + per_token)
    else:
        activations = tokens * shape.layers * per_token
    rotary = 2 * run.seq_len // run.context * shape.head_dim * FP32_BYTES  # cos / sin of this GPU's positions
    activations += tokens * (shape.hidden * 2 * FP32_BYTES + 8) + rotary
    return activations + gathered_kv_bytes(shape, run)


def _logits(shape: ModelShape, run: PlanInputs) -> tuple[float, float]:
    """(kept for backward, made during backward): the plain loss's [T, V] blocks, or the chunked
    scorer's fp32 log-sum-exp per token and one ``[chunk, V]`` fp32 block (the recomputed logits, made
    into their gradient in place), with half a block more under bf16 (the head's bf16 logits beside it,
    then the bf16 gradient); ``tests/test_plan.py`` counts them in a tiny model's backward."""
    tokens = run.tokens
    chunk = chunk_tokens_for(run.loss_chunk_tokens, tokens, shape.vocab)
    if chunk is None:
        return tokens * shape.vocab * PLAIN_LOGITS_SAVED, tokens * shape.vocab * PLAIN_LOGITS_BACKWARD
    block = min(chunk, tokens) * shape.vocab * FP32_BYTES
    return tokens * FP32_BYTES, block * (1.5 if run.precision == "bf16" and not run.cpu else 1.0)


def _weights(shape: ModelShape, run: PlanInputs, weight_copy: int) -> tuple[float, float, float]:
    """(gathered working copies and their gradients, weight copies, all-gather bytes per micro-batch).

    The layers' weight copies (``_layer_copies``) are none where FSDP2 gathers what the GEMMs read: bf16
    weights for autocast, FP8 codes for an FP8 recipe (``param_gather``)."""
    head_copy = 0 if run.cpu else shape.vocab * shape.hidden * BF16_BYTES  # the lm_head GEMM's bf16 weight
    distributed, shard = run.gpus > 1, 1 / run.gpus
    r = RECIPES[run.recipe]
    fp8_gather = distributed and r.param_gather(run.param_gather)  # never NVFP4's: gathered in `wire`
    wire = run.wire
    layer_wire = float(wire * shape.layer_params)
    if fp8_gather:  # projections as the weight cast's codes and block scales, the rest in `wire`
        proj = shape.projection_weights
        layer_wire = (shape.layer_params - proj) * wire + layer_weight_bytes(shape, r.w)
    gemm_reads_gathered = distributed and (fp8_gather if r.enabled else wire == BF16_BYTES)
    copies = 0.0 if gemm_reads_gathered else _layer_copies(shape, run, weight_copy)
    # an untied embedding is an FSDP unit of its own (``harness.distributed.shard_model``): resharded after
    # its forward, gathered again for its backward, the last; the root (final norm, lm_head) stays gathered
    embedding = 0 if shape.tied else shape.vocab * shape.hidden
    working = (
        shape.root_params - embedding
    ) * wire + 2 * layer_wire  # unsharded while in use: root + 2 layers
    gather = (2 * shape.layers * layer_wire + (shape.root_params + embedding) * wire) * (1 - shard)
    gathered = 2 * working * (1 - shard) if distributed else 0.0  # the weights and their gradients
    return gathered, copies + head_copy, gather


def _layer_copies(shape: ModelShape, run: PlanInputs, weight_copy: int) -> float:
    """The decoder layers' weight copies at the start of backward. What a layer's GEMMs save for its
    backward (``weight_copy``: autocast's bf16 casts, or the FP8 copies under ``fp8.weight_cache:
    layer``) lives until that backward: every layer's, or one layer's under activation checkpointing
    (the one recomputed; forward kept none). ``fp8.weight_cache: step`` keeps every layer's FP8 forward
    copy for the whole step and, on CUDA where dgrad reuses it, its K-major transpose beside it.
    Not counted: the transient K-major copy the ``layer`` scope makes in backward, one linear's at a time."""
    r = RECIPES[run.recipe]
    if r.enabled and run.weight_cache == "step":
        # the saved copy is the cached one where dgrad reuses it; else backward quantizes again
        cached = weight_copy if r.reuses_weight else layer_weight_bytes(shape, r.w)
        k_major = not run.cpu and r.k_major_dgrad_weight
        return shape.layers * cached * (2 if k_major else 1)
    return (1 if run.activation_checkpointing else shape.layers) * weight_copy
