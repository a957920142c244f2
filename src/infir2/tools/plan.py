"""Per-GPU memory and all-gather bytes of a training run, BF16 vs FP8, before you launch it.

It plans a GPU run (bf16 autocast over fp32 masters) unless ``--device cpu``: then a CPU run, per
process, as infir2 runs on CPUs (fp32 throughout, FP8 GEMMs emulated in fp32; the baseline is fp32).

``infir2 plan qwen2.5-7b --gpus 8 --seq-len 32768`` (or a Hugging Face ``config.json``) prints, per
GPU, what the run holds at its peak (the start of backward) for the BF16 baseline and the chosen FP8
recipe side by side, next to InfiR2's published FP8/BF16 peak-memory ratios where they exist:

* parameters   fp32 masters, FSDP-sharded: ``4 P / gpus``
* gradients    fp32, sharded: ``4 P / gpus``
* optimizer    AdamW moments: ``8 P / gpus`` (``--state-dtype fp32``) or ``4 P / gpus`` (``bf16``)
* gathered     FSDP2 working copies (only with gpus > 1): the root module's parameters (embedding,
               final norm, lm_head; the root is not resharded after forward) plus two decoder layers
               (the current one and the prefetched next), and their unsharded gradients
* weight copies what each layer's GEMMs keep for backward: autocast's bf16 casts (2 B/param; one
               layer's worth under activation checkpointing) or the FP8 copies with their scales
               (1 B/param + 1/128^2, every layer for the whole step: ``cache_fp8_weights``) -- measured
               per layer by ``infir2 memory``
* activations  per-layer bytes per token, measured by ``infir2 memory`` at the layer's shape, times
               tokens per micro-batch times layers; with activation checkpointing, each layer's fp32
               input plus one layer's full set (the one being recomputed); plus the final norm
* logits       plain loss: the fp32 log-softmax kept for backward (4 T V) and, during backward, its
               gradient and the logits' gradient (8 T V more); chunked: two ``[chunk, V]`` fp32 blocks
* optimizer step  AdamW's temporaries during its step, when the activations are gone: torch's foreach
               AdamW on a CPU (fp32 moments) makes 4 bytes per parameter at once, the fused one on
               CUDA none, ``LowPrecisionAdamW`` three fp32 copies of the largest parameter; the peak
               is the larger of the start of backward and the step
* context      ``--context N`` (context parallelism): activations and logits of ``seq_len / N`` tokens,
               plus each layer's keys and values of the other shards, gathered and kept for attention's
               backward (every layer, or one under activation checkpointing)
* all-gather   bytes each GPU receives per optimizer step: fp32 parameters gathered in forward and
               again for backward (the root once), per micro-batch; reduce-scatter of fp32 gradients

A mixture of experts (``num_experts`` / ``num_local_experts`` / ``n_routed_experts`` in the config) counts
every expert's parameters (total, and the active ones a token reads), gathers every expert's weights
(as FP8 codes with ``param_gather``), keeps every expert's FP8 weight copy, and estimates activations
from the dense layer of the active width (top-k experts + the shared one) plus the experts' extra
copies of each routed row: a lower bound (``tests/test_moe_plan.py``).

Attention is counted as the config says: ``head_dim`` where given (Qwen3's 32 heads of 128 over a hidden
size of 2048), q / k / v biases from ``attention_bias`` (else Qwen2's have them), Qwen3's per-head q / k
norms. ``qwen3-30b-a3b`` is shipped (30.53B parameters, 3.35B active). Not modelled, and said with a
warning (``unmodelled``): DeepSeek-V3's latent attention (MLA) and the dense MLP layers of an MoE
model (DeepSeek-V3's first three, Qwen-MoE's ``mlp_only_layers``): every layer is planned as an MoE
layer.

**An RL step** (``--rl CONFIG``: a shipped RL config's name or a YAML file; the model shape is the
positional model, else ``model.path``'s ``config.json``): ``rollout.batch_size`` responses generated
together, then the old / reference scoring and the update over ``algo.micro_batch_size`` sequences of
``--prompt-len`` + ``rollout.max_new_tokens`` tokens, with ``fp8.recipe``, ``model.precision``,
``model.activation_checkpointing`` and ``optim.state_dtype`` as the config says, FSDP2 over ``--gpus``.
Besides the training terms above (the update's micro-batch, its logits those of the chunked token
scorer) it counts:

* reference    the KL reference (``algo.kl_coef > 0``): a whole fp32 copy of the model on every rank
* engine       the rollout engine's copy (``rollout.precision: fp8``: the FP8 export's projections, 1 byte
               per weight + a 128x128 block's fp32 scale, the rest fp32; ``bf16``: a whole fp32 copy)
* kv cache     ``rollout.batch_size`` x (``--prompt-len`` + ``max_new_tokens``) keys and values of every
               layer (bf16 on GPUs, fp32 on CPUs), plus one layer's more while it grows
* scoring      the no-grad scoring of one micro-batch: its final hidden states and two ``[chunk, V]`` fp32
               blocks of the token scorer (``loss.scorer.chunk_tokens_for``, the 256 MiB budget)

The three phases peak apart (rollout: the weights, optimizer state and KV cache; scoring; the update:
the training plan), over the resident weights, the reference and the engine, and the plan says
plainly when the largest does not fit the ``--gpu`` it names.

Every term is an estimate of allocated tensor bytes (no allocator fragmentation, no CUDA context, no
NCCL buffers); ``tests/test_plan.py`` checks the parameter, gradient, optimizer, activation and
logits terms against bytes measured on tiny models.

    infir2 plan qwen2.5-1.5b --gpus 8 --seq-len 8192
    infir2 plan qwen2.5-7b --gpus 8 --seq-len 131072 --context 8 --activation-checkpointing
    infir2 plan qwen3-30b-a3b --gpus 8 --seq-len 32768 --activation-checkpointing --gpu h200
    infir2 plan path/to/config.json --gpus 4 --seq-len 32768 --recipe blockwise --state-dtype bf16 \\
        --activation-checkpointing --loss-chunk-tokens auto
    infir2 plan qwen2.5-7b --rl qwen2.5-7b-rl --gpus 8 --gpu h200
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..fp8 import RECIPES, recipe_names
from ..fp8.formats import BLOCK
from .memory import DEVICES, add_run_arguments

log = logging.getLogger(__name__)

__all__ = [
    "MODELS",
    "PUBLISHED",
    "ModelShape",
    "Plan",
    "RLPlan",
    "add_arguments",
    "layer_figures",
    "plan",
    "plan_rl",
    "run",
    "unmodelled",
]

#: The shipped models' config.json fields that the plan needs (the Qwen2.5 and Qwen3-MoE releases).
MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-30B-A3B's config.json: 30.5B parameters, 3.3B active (128 experts, 8 per token)
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "attention_bias": False,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
}

#: model types whose q / k / v projections have biases when the config has no ``attention_bias``
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
#: model types with an RMSNorm of ``head_dim`` on each head's query and key (``q_norm`` / ``k_norm``)
QK_NORM_TYPES = ("qwen3", "qwen3_moe")

#: InfiR2's reported FP8 / BF16 peak memory: model -> {sequence length: ratio}.
PUBLISHED: dict[str, dict[int, float]] = {
    "qwen2.5-1.5b": {8192: 0.86, 32768: 0.89},
    "qwen2.5-7b": {8192: 0.95, 32768: 0.86},
}

#: Per decoder layer (hidden, intermediate, heads, kv heads, SwiGLU recompute) -> recipe -> (activation bytes per token,
#: weight-copy bytes), as printed by ``infir2 memory --tokens 384`` (BENCHMARKS.md); other shapes are
#: measured on the fly by ``layer_figures`` (a head_dim other than hidden // heads: last in the key).
MEASURED: dict[tuple[int | bool, ...], dict[str, tuple[float, int]]] = {
    (1536, 8960, 12, 2, False): {
        "bf16": (118840, 93585408),
        "blockwise": (99552, 46804128),
        "blockwise_fp32scale": (99552, 46804128),
        "rowwise": (99269, 0),
        "tensorwise": (99128, 46792732),
    },
    (3584, 18944, 28, 4, False): {
        "bf16": (261240, 466092032),
        "blockwise": (218136, 233102912),
        "blockwise_fp32scale": (218136, 233102912),
        "rowwise": (217517, 0),
        "tensorwise": (217208, 233046044),
    },
    # with the SwiGLU recompute training applies by default (``infir2 memory``, same command, 2026-11-30)
    (1536, 8960, 12, 2, True): {
        "bf16": (100920, 93585408),
        "blockwise": (81632, 46804128),
        "blockwise_fp32scale": (81632, 46804128),
        "mxfp8": (81632, 0),
        "rowwise": (81349, 0),
        "tensorwise": (81208, 46792732),
    },
    (3584, 18944, 28, 4, True): {
        "bf16": (223352, 466092032),
        "blockwise": (180248, 233102912),
        "mxfp8": (180248, 0),
        "tensorwise": (179320, 233046044),
    },
    # Qwen3-30B-A3B's layer at its active width (8 x 768; head_dim 128), SwiGLU recompute (layer_figures,
    # 2026-12-01)
    (2048, 6144, 32, 4, True, 128): {
        "bf16": (108680, 113246208),
        "blockwise": (90696, 56650752),
    },
}

#: the same figures for a CPU run (``device="cpu"``), measured when first asked for
MEASURED_CPU: dict[tuple[int | bool, ...], dict[str, tuple[float, int]]] = {}

FP32_BYTES, BF16_BYTES = 4, 2
PLAIN_LOGITS_SAVED, PLAIN_LOGITS_BACKWARD = 4, 8  # bytes per logit: fp32 log-softmax; its + the logits' grads


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    # mixture of experts (every layer; 0 experts: a dense MLP of ``intermediate``)
    experts: int = 0  # routed experts per layer
    expert_intermediate: int = 0  # each expert's width I (gate_up [2I, H], down [H, I])
    top_k: int = 0  # experts per token
    shared_intermediate: int = 0  # the shared expert(s)' width (0: none)
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert (a [1, H] linear)
    # attention: each head's width (0: hidden // heads), q / k / v biases, Qwen3's q_norm / k_norm
    head_dim: int = 0
    qkv_bias: bool = True
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str) -> ModelShape:
        keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [k for k in keys if k not in config]
        if missing:
            raise ValueError(f"{source}: missing {', '.join(missing)}")
        return cls(
            config["hidden_size"],
            config["intermediate_size"],
            config["num_hidden_layers"],
            config["num_attention_heads"],
            config.get("num_key_value_heads", config["num_attention_heads"]),
            config["vocab_size"],
            bool(config.get("tie_word_embeddings", False)),
            **_moe_fields(config, source),
            **_attention_fields(config),
        )

    @property
    def _attention_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        biases = q + 2 * kv if self.qkv_bias else 0
        norms = 2 * self.head_dim if self.qk_norm else 0
        return 2 * h * q + 2 * h * kv + biases + norms  # q, o, k, v (+ biases, q_norm / k_norm)

    @property
    def _mlp_projections(self) -> int:
        """Elements of one layer's MLP GEMM weights: gate, up, down (of every expert, and the shared one)."""
        if not self.experts:
            return 3 * self.hidden * self.intermediate
        return 3 * self.hidden * (self.experts * self.expert_intermediate + self.shared_intermediate)

    @property
    def active_intermediate(self) -> int:
        """The MLP width one token runs through: ``intermediate``, or top-k experts plus the shared one."""
        if not self.experts:
            return self.intermediate
        return self.top_k * self.expert_intermediate + self.shared_intermediate

    @property
    def layer_params(self) -> int:
        router = self.experts * self.hidden + (self.hidden if self.shared_gate else 0)
        return self._attention_params + self._mlp_projections + router + 2 * self.hidden  # two RMSNorms

    @property
    def projection_weights(self) -> int:
        """Elements of one layer's projection weights (what FP8 quantizes and FP8-gathers): attention and
        MLP, every expert's."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * h * q + 2 * h * kv + self._mlp_projections

    @property
    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden  # embed (+ lm_head), norm

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def active_params(self) -> int:
        """Parameters one token's forward reads (the top-k experts of each layer, not all of them)."""
        if not self.experts:
            return self.params
        idle = 3 * self.hidden * (self.experts - self.top_k) * self.expert_intermediate
        return self.params - self.layers * idle


def _moe_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The MoE fields of a HF config (Qwen3-MoE / Qwen2-MoE: num_experts, Mixtral: num_local_experts,
    DeepSeek-V3: n_routed_experts); empty for a dense model."""
    experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
    if not experts:
        return {}
    if "num_experts_per_tok" not in config:
        raise ValueError(f"{source}: {experts} experts but no num_experts_per_tok")
    width = config.get("moe_intermediate_size") or config["intermediate_size"]  # Mixtral: intermediate_size
    shared = config.get("shared_expert_intermediate_size") or (config.get("n_shared_experts") or 0) * width
    return {
        "experts": experts,
        "expert_intermediate": width,
        "top_k": config["num_experts_per_tok"],
        "shared_intermediate": shared,
        "shared_gate": bool(config.get("shared_expert_intermediate_size")),
    }


def _attention_fields(config: dict[str, Any]) -> dict[str, Any]:
    """``head_dim`` (when the config gives one), q / k / v biases (``attention_bias``, else by model
    type: Qwen2's have them) and Qwen3's per-head q / k norms."""
    model_type = config.get("model_type", "qwen2")
    return {
        "head_dim": config.get("head_dim") or 0,
        "qkv_bias": bool(config.get("attention_bias", model_type in QKV_BIAS_TYPES)),
        "qk_norm": model_type in QK_NORM_TYPES,
    }


def load_shape(model: str) -> tuple[str, ModelShape]:
    """A shipped model name or the path of a HF ``config.json`` (or its folder)."""
    if model.lower() in MODELS:
        return model.lower(), ModelShape.from_config(MODELS[model.lower()], model)
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{model}: not a shipped model ({', '.join(MODELS)}) nor a config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {e.lineno}: {e.msg}") from e
    shape = ModelShape.from_config(config, str(path))
    for note in unmodelled(config):
        log.warning("%s: %s", path, note)
    return str(path), shape


def unmodelled(config: dict[str, Any]) -> list[str]:
    """What of a HF config the plan counts as something simpler (said, never silently)."""
    notes = []
    if config.get("kv_lora_rank"):
        notes.append(
            "latent attention (MLA, kv_lora_rank) is planned as plain attention of num_attention_heads x "
            "head_dim: parameters, bytes and activations are approximate"
        )
    dense = config.get("first_k_dense_replace") or config.get("mlp_only_layers")
    if _moe_fields(config, "") and (dense or (config.get("decoder_sparse_step") or 1) > 1):
        notes.append(
            "its dense MLP layers (first_k_dense_replace, mlp_only_layers or decoder_sparse_step) are "
            "planned as MoE layers"
        )
    return notes


def layer_figures(
    shape: ModelShape, recipe: str, recompute_mlp: bool = True, device: str = "cuda"
) -> tuple[float, int]:
    """(activation bytes per token, weight-copy bytes) of one decoder layer: measured, cached.
    ``MEASURED`` holds GPU figures; a CPU run's (fp32, no autocast) are measured on the fly.

    An MoE layer is estimated from the dense layer of its active width (``active_intermediate``: what
    one token's top-k experts and the shared expert keep), plus the k - 1 extra copies of each token's
    input the experts keep (one per routed row: FP8 bytes, or bf16), with weight copies scaled to all
    experts' weights (each expert's FP8 copy lives for the step).
    """
    dense = ModelShape(
        shape.hidden,
        shape.active_intermediate,
        shape.layers,
        shape.heads,
        shape.kv_heads,
        shape.vocab,
        shape.tied,
        head_dim=shape.head_dim,
    )
    key: tuple[int | bool, ...] = (
        dense.hidden,
        dense.intermediate,
        dense.heads,
        dense.kv_heads,
        recompute_mlp,
    )
    if dense.head_dim != dense.hidden // dense.heads:
        key += (dense.head_dim,)  # heads of another width than hidden // heads: keyed apart
    table = MEASURED if device == "cuda" else MEASURED_CPU
    if recipe not in table.get(key, {}):
        from .memory import layer_memory, safe_tokens

        heads = {dense.heads * dense.head_dim, dense.kv_heads * dense.head_dim}
        tokens = safe_tokens({dense.hidden, dense.intermediate, *heads})

        m = layer_memory(
            "",
            recipe,
            tokens,
            recompute_mlp,
            device,
            hidden_size=dense.hidden,
            intermediate_size=dense.intermediate,
            num_attention_heads=dense.heads,
            num_key_value_heads=dense.kv_heads,
            head_dim=dense.head_dim,
        )
        table.setdefault(key, {})[recipe] = (m.per_token, m.total("weight"))
    per_token, weight_copy = table[key][recipe]
    if not shape.experts:
        return per_token, weight_copy
    row_bytes = 1 if RECIPES[recipe].enabled else BF16_BYTES
    per_token += (shape.top_k - 1) * shape.hidden * row_bytes
    return per_token, round(weight_copy * shape.projection_weights / dense.projection_weights)


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


def plan(
    shape: ModelShape,
    recipe: str,
    gpus: int = 1,
    seq_len: int = 8192,
    micro_batch: int = 1,
    global_batch: int | None = None,
    activation_checkpointing: bool = False,
    state_dtype: str = "fp32",
    loss_chunk_tokens: int | str = "auto",
    recompute_mlp: bool = True,
    precision: str = "bf16",
    param_gather: bool | None = None,
    device: str = "cuda",
    context: int = 1,
) -> Plan:
    """The memory and traffic of one GPU; ``recipe`` is ``bf16`` (baseline) or an FP8 recipe.

    ``device="cpu"`` plans a CPU run instead (per process): fp32 compute without autocast
    (``precision`` is then fp32), so no bf16 weight or lm_head copies, fp32 activations, and an FP8
    recipe's weight cache holds the FP8 codes of every layer (the CPU emulation decodes them per GEMM).

    Under FSDP (``gpus > 1``) parameters travel in ``precision`` (bf16 mixed precision, or fp32), and
    an FP8 recipe's projection weights as FP8 codes (1 byte) when ``param_gather`` (default: as
    ``fp8.param_gather``, on for the block-scaled recipes); the gathered weight is then the GEMMs' copy,
    so no per-step weight cache is kept.

    ``context``: context parallelism (``parallel.context``; ``gpus`` is data x context): each GPU keeps
    the activations and logits of ``seq_len / context`` tokens, plus every layer's keys and values
    gathered over the whole sequence (``context_kv_bytes``); FSDP still shards over all ``gpus``.
    """
    from ..loss.scorer import chunk_tokens_for

    if device not in DEVICES:
        raise ValueError(f"device: expected one of {', '.join(DEVICES)}, got {device!r}")
    if context < 1 or gpus % context:
        raise ValueError(
            f"context: {context} must be >= 1 and divide gpus={gpus} (the GPUs are data x context)"
        )
    cpu = device == "cpu"
    precision = "fp32" if cpu else precision
    tokens = seq_len * micro_batch // context  # this GPU's share of each micro-batch
    per_token, weight_copy = layer_figures(shape, recipe, recompute_mlp, device)
    p, shard = shape.params, 1 / gpus
    if activation_checkpointing:
        activations = tokens * (shape.layers * shape.hidden * FP32_BYTES + per_token)
    else:
        activations = tokens * shape.layers * per_token
    # outside the layers: final norm (input, normalized output), token ids, rotary cos/sin (once)
    rotary = 2 * seq_len // context * shape.head_dim * FP32_BYTES  # cos / sin of this GPU's positions
    activations += tokens * (shape.hidden * 2 * FP32_BYTES + 8) + rotary
    kv_layers = 1 if activation_checkpointing else shape.layers  # checkpointed: one layer's, recomputed
    activations += kv_layers * context_kv_bytes(shape, seq_len * micro_batch, context, cpu)
    chunk = chunk_tokens_for(loss_chunk_tokens, tokens, shape.vocab)
    if chunk is None:
        saved, backward = (
            tokens * shape.vocab * PLAIN_LOGITS_SAVED,
            tokens * shape.vocab * PLAIN_LOGITS_BACKWARD,
        )
    else:
        saved, backward = tokens * FP32_BYTES, 2 * min(chunk, tokens) * shape.vocab * FP32_BYTES
    head_copy = 0 if cpu else shape.vocab * shape.hidden * BF16_BYTES  # the lm_head GEMM's bf16 weight
    # autocast's bf16 copies live as long as a saved tensor holds them: one layer under activation
    # checkpointing; the FP8 copies live for the whole step (cache_fp8_weights), checkpointing or not
    copied_layers = 1 if activation_checkpointing and recipe == "bf16" else shape.layers
    distributed = gpus > 1
    r = RECIPES[recipe]
    fp8_gather = distributed and r.param_gather_default
    fp8_gather = fp8_gather if param_gather is None else (param_gather and distributed and r.enabled)
    wire = BF16_BYTES if precision == "bf16" else FP32_BYTES
    layer_wire = float(wire * shape.layer_params)
    if fp8_gather:  # projections as FP8 codes + one fp32 scale per 128x128 block, the rest in `wire`
        proj = shape.projection_weights
        layer_wire = (shape.layer_params - proj) * wire + proj * (1 + FP32_BYTES / BLOCK**2)
    if distributed and (precision == "bf16" or fp8_gather):
        copied_layers = 0  # the gathered weights are already what the GEMMs read
    working = shape.root_params * wire + 2 * layer_wire  # unsharded while in use: root + 2 layers
    data = gpus // context  # the sequences one forward on every GPU takes, in micro-batches
    micro_steps = max((global_batch or micro_batch * data) // (micro_batch * data), 1)
    gather = (2 * shape.layers * layer_wire + shape.root_params * wire) * (1 - shard)
    return Plan(
        parameters=FP32_BYTES * p * shard,
        gradients=FP32_BYTES * p * shard,
        optimizer=(2 * FP32_BYTES if state_dtype == "fp32" else 2 * BF16_BYTES) * p * shard,
        gathered=2 * working * (1 - shard) if distributed else 0.0,  # the weights and their gradients
        weight_copies=copied_layers * weight_copy + head_copy,
        activations=activations,
        logits_saved=saved,
        logits_backward=backward,
        all_gather=gather * micro_steps,
        reduce_scatter=FP32_BYTES * p * (1 - shard) * micro_steps,
        optimizer_step=_optimizer_step_bytes(shape, state_dtype, cpu) * shard,
    )


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


def plan_rl(
    shape: ModelShape, cfg: Any, gpus: int = 1, prompt_len: int = 512, device: str = "cuda"
) -> RLPlan:
    """The memory of one RL step of ``cfg`` (an ``RLConfig``) on one of ``gpus`` GPUs (FSDP2), or one CPU
    process (``device="cpu"``), for prompts of ``prompt_len`` tokens."""
    from ..loss.scorer import chunk_tokens_for

    cpu = device == "cpu"
    seq = prompt_len + cfg.rollout.max_new_tokens
    micro = cfg.algo.micro_batch_size
    update = plan(
        shape,
        cfg.fp8.recipe,
        gpus=gpus,
        seq_len=seq,
        micro_batch=micro,
        activation_checkpointing=cfg.model.activation_checkpointing,
        state_dtype=cfg.optim.state_dtype,
        loss_chunk_tokens="auto",
        recompute_mlp=cfg.model.recompute_mlp,
        precision=cfg.model.precision if cfg.model.precision != "fp64" else "fp32",
        device=device,
    )
    whole = FP32_BYTES * shape.params
    if cfg.rollout.precision == "fp8":  # ServingFp8Linear: FP8 codes + one fp32 scale per 128x128 block
        proj = shape.projection_weights * shape.layers
        engine = proj * (1 + FP32_BYTES / BLOCK**2) + (shape.params - proj) * FP32_BYTES
    else:
        engine = whole
    kv_dtype = FP32_BYTES if cpu else BF16_BYTES
    per_layer = 2 * shape.kv_heads * shape.head_dim * kv_dtype * cfg.rollout.batch_size * seq
    responses = micro * cfg.rollout.max_new_tokens
    chunk = chunk_tokens_for("auto", responses, shape.vocab)
    block = min(chunk or responses, responses) * shape.vocab * FP32_BYTES
    return RLPlan(
        update=update,
        reference=whole if cfg.algo.kl_coef > 0 else 0.0,
        engine=engine,
        kv_cache=per_layer * (shape.layers + 1),
        rollout_logits=3 * cfg.rollout.batch_size * shape.vocab * FP32_BYTES,
        scoring=micro * seq * shape.hidden * FP32_BYTES + 2 * block,
    )


def format_rl_plan(p: RLPlan, device: str = "cuda") -> str:
    gib = 2**30
    u = p.update
    rows = [
        ("parameters", u.parameters),
        ("optimizer", u.optimizer),
        ("reference (KL)", p.reference),
        ("rollout engine", p.engine),
        ("rollout kv cache", p.kv_cache),
        ("rollout logits", p.rollout_logits),
        ("scoring", p.scoring),
        ("update gradients", u.gradients),
        ("update gathered", u.gathered),
        ("update weight copies", u.weight_copies),
        ("update activations", u.activations),
        ("update logits", u.logits_saved + u.logits_backward),
        ("peak in rollout", p.rollout_peak),
        ("peak in scoring", p.scoring_peak),
        ("peak in the update", p.update_peak),
        ("peak", p.peak),
    ]
    where = "per GPU (GiB)" if device == "cuda" else "per process (GiB)"
    return "\n".join([f"{where:<24}{'':>10}"] + [f"{name:<24}{value / gib:>10.2f}" for name, value in rows])


def rl_fit(p: RLPlan, gpu: str) -> str:
    """Whether the RL step's peak fits ``USABLE`` of ``gpu``: said plainly, with the phase that peaks."""
    gib, limit = 2**30, GPU_GIB[gpu] * USABLE * 2**30
    phase = max(
        (p.rollout_peak, "the rollout"), (p.scoring_peak, "the scoring"), (p.update_peak, "the update")
    )[1]
    if p.peak <= limit:
        return (
            f"fits a {gpu.upper()} ({GPU_GIB[gpu]:.0f} GiB): peak {p.peak / gib:.1f} GiB per GPU, in {phase}"
        )
    return (
        f"does not fit a {gpu.upper()} ({GPU_GIB[gpu]:.0f} GiB, {USABLE:.0%} usable): peak {p.peak / gib:.1f} "
        f"GiB per GPU, in {phase} (more GPUs shard the policy and its optimizer, not the reference or the "
        "engine, which every rank holds whole)"
    )


def context_kv_bytes(shape: ModelShape, tokens: int, context: int, cpu: bool) -> float:
    """What one layer keeps beyond its shard under context parallelism: the keys and values of the
    other ``context - 1`` shards of ``tokens`` (the whole micro-batch), gathered for attention and saved
    for its backward (fp32 on a CPU, bf16 under autocast)."""
    if context == 1:
        return 0.0
    kv = shape.kv_heads * shape.head_dim
    width = FP32_BYTES if cpu else BF16_BYTES
    return 2 * kv * width * tokens * (context - 1) / context


def _optimizer_step_bytes(shape: ModelShape, state_dtype: str, cpu: bool) -> float:
    """AdamW's temporaries in its step: fp32 moments on a CPU run torch's foreach AdamW, whose step
    makes an fp32 tensor per parameter at once (``sqrt(v)``: 4 bytes per parameter); on CUDA the fused
    one makes none. bf16 moments (``LowPrecisionAdamW``) go parameter by parameter: three fp32
    copies of the largest (the embedding)."""
    if state_dtype != "fp32":
        return 3 * FP32_BYTES * shape.vocab * shape.hidden
    return FP32_BYTES * shape.params if cpu else 0.0


ROWS = (
    "parameters",
    "gradients",
    "optimizer",
    "gathered",
    "weight_copies",
    "activations",
    "logits_saved",
    "logits_backward",
)


def format_plan(name: str, base: Plan, fp8: Plan, recipe: str, seq_len: int, device: str = "cuda") -> str:
    gib = 2**30
    where, baseline = ("per GPU (GiB)", "bf16") if device == "cuda" else ("per process (GiB)", "fp32")
    lines = [f"{where:<22}{baseline:>10}{recipe:>22}{'fp8/' + baseline:>10}"]
    for row in ROWS:
        b, f = getattr(base, row), getattr(fp8, row)
        ratio = f"{f / b:.3f}" if b else "1.000" if not f else "-"
        lines.append(f"{row:<22}{b / gib:>10.2f}{f / gib:>22.2f}{ratio:>10}")
    b, f = base.optimizer_step, fp8.optimizer_step
    lines.append(f"{'optimizer_step':<22}{b / gib:>10.2f}{f / gib:>22.2f}{(f / b if b else 1.0):>10.3f}")
    for label, attr in (("peak in backward", "backward_peak"), ("peak in the step", "step_peak")):
        b, f = getattr(base, attr), getattr(fp8, attr)
        lines.append(f"{label:<22}{b / gib:>10.2f}{f / gib:>22.2f}{f / b:>10.3f}")
    lines.append(f"{'peak':<22}{base.peak / gib:>10.2f}{fp8.peak / gib:>22.2f}{fp8.peak / base.peak:>10.3f}")
    for row in ("all_gather", "reduce_scatter"):
        lines.append(f"{row + ' /step':<22}{getattr(base, row) / gib:>10.2f}{getattr(fp8, row) / gib:>22.2f}")
    published = PUBLISHED.get(name, {}) if device == "cuda" else {}
    if published:
        rows = ", ".join(f"{ratio:.2f}x at {length // 1024}k" for length, ratio in sorted(published.items()))
        lines.append(
            f"InfiR2 published FP8/BF16 peak memory ({name}): {rows}; this plan at "
            f"{seq_len // 1024}k: {fp8.peak / base.peak:.2f}x"
        )
    return "\n".join(lines)


#: memory of one GPU (GiB) by name: what a plan must fit (``--gpu``)
GPU_GIB: dict[str, float] = {"h100": 80.0, "h200": 141.0, "a100": 80.0, "b200": 180.0, "l40s": 48.0}
#: the share of a GPU a plan may fill: the CUDA context, the allocator's fragmentation and NCCL buffers
#: take the rest
USABLE = 0.9


def fit_advice(shape: ModelShape, recipe: str, kw: dict[str, Any], peak: float, gpu: str) -> str:
    """Whether the FP8 plan's peak fits ``USABLE`` of ``gpu``, and if not, what would (each planned)."""
    gib, limit = 2**30, GPU_GIB[gpu] * USABLE * 2**30
    if peak <= limit:
        return f"fits a {gpu.upper()} ({GPU_GIB[gpu]:.0f} GiB): peak {peak / gib:.1f} GiB per GPU"
    options = []
    if not kw["activation_checkpointing"]:
        with_ac = plan(shape, recipe, **{**kw, "activation_checkpointing": True}).peak
        options.append(f"activation checkpointing ({with_ac / gib:.1f} GiB)")
    for gpus in (kw["gpus"] * 2, kw["gpus"] * 4, kw["gpus"] * 8):
        more = plan(shape, recipe, **{**kw, "gpus": gpus}).peak
        if more <= limit:
            options.append(f"{gpus} GPUs ({more / gib:.1f} GiB)")
            break
    for context in (2, 4, 8):
        if kw["context"] < context and kw["gpus"] % context == 0 and kw["seq_len"] % (context * BLOCK) == 0:
            sharded = plan(shape, recipe, **{**kw, "context": context}).peak
            if sharded <= limit:
                options.append(f"--context {context} ({sharded / gib:.1f} GiB)")
                break
    seq = kw["seq_len"] // 2
    while seq >= 1024:
        shorter = plan(shape, recipe, **{**kw, "seq_len": seq}).peak
        if shorter <= limit:
            options.append(f"--seq-len {seq} ({shorter / gib:.1f} GiB)")
            break
        seq //= 2
    what = "; ".join(options) or "nothing tried here fits (a larger GPU, or context parallelism)"
    return (
        f"warning: does not fit a {gpu.upper()} ({GPU_GIB[gpu]:.0f} GiB, {USABLE:.0%} usable): FP8 peak "
        f"{peak / gib:.1f} GiB per GPU. What would fit, each alone: {what}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        help=f"a shipped model ({', '.join(MODELS)}) or a HF config.json / folder (with --rl: default "
        "model.path's config.json)",
    )
    parser.add_argument(
        "--rl",
        metavar="CONFIG",
        help="plan one RL step of this RL config (a shipped name such as qwen2.5-7b-rl, or a YAML file)",
    )
    parser.add_argument(
        "--prompt-len", type=int, default=512, help="with --rl: prompt tokens before each response"
    )
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument(
        "--gpu",
        choices=sorted(GPU_GIB),
        default="h100",
        help="the GPU the plan must fit (default h100, 80 GiB; a plan over 90%% of it is said, with what fits)",
    )
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per forward")
    parser.add_argument(
        "--global-batch", type=int, default=None, help="sequences per step (default: one each)"
    )
    parser.add_argument("--recipe", default="blockwise", help=f"FP8 recipe: {', '.join(RECIPES)}")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32", help="AdamW moments")
    parser.add_argument(
        "--loss-chunk-tokens", default="auto", help="auto | 0 (plain loss) | tokens per chunk"
    )
    parser.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default="bf16",
        help="model.precision: the dtype parameters travel in under FSDP",
    )
    add_run_arguments(
        parser,
        device_help=(
            "the run planned: cuda (GPUs, bf16 autocast; default) or cpu (fp32 emulation, per process)"
        ),
        recompute_help="without the SwiGLU recompute (model.recompute_mlp: false)",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=1,
        help="context parallelism (parallel.context): GPUs that share each sequence; --gpus is data x context",
    )
    parser.add_argument(
        "--no-param-gather",
        action="store_true",
        help="FP8 projections gathered in --precision, not as FP8 (fp8.param_gather: false)",
    )


def _chunk_tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(
            f"--loss-chunk-tokens: expected auto, 0 or a number of tokens, got {text!r}"
        ) from None
    if value < 0:
        raise ValueError(f"--loss-chunk-tokens must be >= 0, got {value}")
    return value


def _check_context(context: int, gpus: int, seq_len: int) -> None:
    if context < 1 or gpus % context:
        raise ValueError(
            f"--context {context}: must be >= 1 and divide --gpus {gpus} (the GPUs are data x context)"
        )
    if context > 1 and seq_len % (context * BLOCK):
        raise ValueError(
            f"--seq-len {seq_len} does not split into --context {context} shards of a multiple of {BLOCK} "
            f"tokens (make it a multiple of {context * BLOCK})"
        )


def run_rl(args: argparse.Namespace) -> int:
    """``infir2 plan --rl CONFIG``: one RL step of the config, on ``--gpus`` GPUs (or CPU processes)."""
    from ..rl.config import load_rl_config
    from ..train.config import resolve_config_path

    cfg = load_rl_config(resolve_config_path(args.rl))
    if args.gpus <= 0 or args.prompt_len <= 0:
        raise ValueError(f"--gpus and --prompt-len must be > 0, got {args.gpus} and {args.prompt_len}")
    model = args.model
    if model is None:
        folder = Path(cfg.model.path) if cfg.model.path else None
        if folder is None or not (folder / "config.json").is_file():
            raise ValueError(
                f"--rl {args.rl}: model.path {cfg.model.path!r} has no config.json here; name the model "
                f"shape: a shipped model ({', '.join(MODELS)}) or a config.json"
            )
        model = str(folder)
    name, shape = load_shape(model)
    p = plan_rl(shape, cfg, args.gpus, args.prompt_len, args.device)
    where = f"{args.gpus} GPUs" if args.device == "cuda" else f"{args.gpus} CPU processes, fp32 emulation"
    r, a = cfg.rollout, cfg.algo
    print(
        f"{name}, RL step of {args.rl}: {shape.params / 1e9:.2f}B parameters, {where} (FSDP2), recipe "
        f"{cfg.fp8.recipe}, rollout {r.precision} x {r.batch_size} sequences of {args.prompt_len} + "
        f"{r.max_new_tokens} tokens, micro-batch {a.micro_batch_size}, KL reference "
        f"{'on' if a.kl_coef > 0 else 'off'}, AC {'on' if cfg.model.activation_checkpointing else 'off'}"
    )
    print(format_rl_plan(p, args.device))
    if args.device == "cuda":
        print(rl_fit(p, args.gpu))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.rl:
        return run_rl(args)
    if args.model is None:
        raise ValueError("model: name a shipped model or a config.json (or plan an RL step with --rl CONFIG)")
    recipe_names(args.recipe, "--recipe")  # one name, checked by get_recipe
    for key in ("gpus", "seq_len", "micro_batch"):
        if getattr(args, key) <= 0:
            raise ValueError(f"--{key.replace('_', '-')}: must be > 0, got {getattr(args, key)}")
    _check_context(args.context, args.gpus, args.seq_len)
    per_step = args.gpus // args.context * args.micro_batch  # sequences one forward on every GPU takes
    across = " / --context" if args.context > 1 else ""
    if args.global_batch is not None and (args.global_batch <= 0 or args.global_batch % per_step):
        raise ValueError(
            f"--global-batch {args.global_batch} is not a multiple of --gpus{across} x --micro-batch = "
            f"{per_step} (each optimizer step runs whole micro-batches on every GPU)"
        )
    chunk: int | str = (
        args.loss_chunk_tokens if args.loss_chunk_tokens == "auto" else _chunk_tokens(args.loss_chunk_tokens)
    )
    name, shape = load_shape(args.model)
    kw = {
        "gpus": args.gpus,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "global_batch": args.global_batch,
        "activation_checkpointing": args.activation_checkpointing,
        "state_dtype": args.state_dtype,
        "loss_chunk_tokens": chunk,
        "precision": args.precision,
        "recompute_mlp": not args.no_recompute_mlp,
        "param_gather": False if args.no_param_gather else None,
        "device": args.device,
        "context": args.context,
    }
    experts = (
        f" ({shape.active_params / 1e9:.2f}B active: {shape.top_k} of {shape.experts} experts per layer)"
        if shape.experts
        else ""
    )
    where = f"{args.gpus} GPUs" if args.device == "cuda" else f"{args.gpus} CPU processes, fp32 emulation"
    print(
        f"{name}: {shape.params / 1e9:.2f}B parameters{experts}, {where}, {args.seq_len} x {args.micro_batch} "
        f"tokens per micro-batch{f' over {args.context} context ranks' if args.context > 1 else ''}, "
        f"AC {'on' if args.activation_checkpointing else 'off'}, AdamW moments "
        f"{args.state_dtype}, loss chunk {chunk}"
    )
    base, fp8 = plan(shape, "bf16", **kw), plan(shape, args.recipe, **kw)
    print(format_plan(name, base, fp8, args.recipe, args.seq_len, args.device))
    if args.device == "cuda":
        print(fit_advice(shape, args.recipe, kw, fp8.peak, args.gpu))
    if shape.experts:
        print(
            "mixture of experts: activations and weight copies estimated from a dense layer of the active "
            "width (a lower bound: tiny MoE models keep 25-35% more); parameters and all-gather bytes exact"
        )
    return 0
