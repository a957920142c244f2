"""The training step's terms, per GPU (or per CPU process): ``plan(shape, recipe, **settings)``.

* parameters   fp32 masters, FSDP-sharded: ``4 P / gpus``; gradients the same
* optimizer    AdamW moments: ``8 P / gpus`` (``state_dtype="fp32"``) or ``4 P / gpus`` (``bf16``)
* gathered     FSDP2 working copies (gpus > 1): the root module's parameters plus two decoder layers
               (the current one and the prefetched next), and their unsharded gradients
* weight copies what each layer's GEMMs keep for backward (``layer.layer_figures``)
* activations  per-layer bytes per token times tokens times layers; with activation checkpointing each
               layer's fp32 input plus one layer's full set; plus the final norm and the context term
* logits       plain loss: the fp32 log-softmax (4 T V) and, in backward, its and the logits' gradients
               (8 T V); chunked: one ``[chunk, V]`` fp32 block (1.5 under bf16: the bf16 logits beside it)
* optimizer step  AdamW's temporaries during its step, when the activations are gone
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
        return self.parameters + self.gradients + self.optimizer + self.optimizer_step

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
    so no per-step weight cache is kept. A CPU run: no bf16 weight or lm_head copies, fp32 activations,
    and an FP8 recipe's weight cache holds the FP8 codes of every layer.
    """
    per_token, weight_copy = layer_figures(shape, run.recipe, run.recompute_mlp, run.device)
    p, shard = shape.params, 1 / run.gpus
    saved, backward = _logits(shape, run)
    gathered, weight_copies, gather = _weights(shape, run, weight_copy)
    micro_steps = max((run.global_batch or run.micro_batch * run.data) // (run.micro_batch * run.data), 1)
    return Plan(
        parameters=FP32_BYTES * p * shard,
        gradients=FP32_BYTES * p * shard,
        optimizer=(2 * FP32_BYTES if run.state_dtype == "fp32" else 2 * BF16_BYTES) * p * shard,
        gathered=gathered,
        weight_copies=weight_copies,
        activations=_activations(shape, run, per_token),
        logits_saved=saved,
        logits_backward=backward,
        all_gather=gather * micro_steps,
        reduce_scatter=FP32_BYTES * p * (1 - shard) * micro_steps,
        optimizer_step=_optimizer_step_bytes(shape, run.state_dtype, run.cpu) * shard,
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

    autocast's bf16 copies live as long as a saved tensor holds them (one layer under activation
    checkpointing); the FP8 copies for the whole step (``cache_fp8_weights``), checkpointing or not."""
    head_copy = 0 if run.cpu else shape.vocab * shape.hidden * BF16_BYTES  # the lm_head GEMM's bf16 weight
    copied_layers = 1 if run.activation_checkpointing and run.recipe == "bf16" else shape.layers
    distributed, shard = run.gpus > 1, 1 / run.gpus
    r = RECIPES[run.recipe]
    fp8_gather = distributed and r.param_gather(run.param_gather)  # never NVFP4's: gathered in `wire`
    wire = run.wire
    layer_wire = float(wire * shape.layer_params)
    if fp8_gather:  # projections as the weight cast's codes and block scales, the rest in `wire`
        proj = shape.projection_weights
        layer_wire = (shape.layer_params - proj) * wire + layer_weight_bytes(shape, r.w)
    if distributed and (wire == BF16_BYTES or fp8_gather):
        copied_layers = 0  # the gathered weights are already what the GEMMs read
    working = shape.root_params * wire + 2 * layer_wire  # unsharded while in use: root + 2 layers
    gather = (2 * shape.layers * layer_wire + shape.root_params * wire) * (1 - shard)
    gathered = 2 * working * (1 - shard) if distributed else 0.0  # the weights and their gradients
    return gathered, copied_layers * weight_copy + head_copy, gather


def _optimizer_step_bytes(shape: ModelShape, state_dtype: str, cpu: bool) -> float:
    """AdamW's temporaries in its step: fp32 moments on a CPU run torch's foreach AdamW, whose step
    makes an fp32 tensor per parameter at once (``sqrt(v)``: 4 bytes per parameter); on CUDA the fused
    one makes none. bf16 moments (``LowPrecisionAdamW``) go parameter by parameter: three fp32
    copies of the largest (the embedding)."""
    if state_dtype != "fp32":
        return 3 * FP32_BYTES * shape.vocab * shape.hidden
    return FP32_BYTES * shape.params if cpu else 0.0
