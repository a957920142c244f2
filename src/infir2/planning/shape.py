"""The shape of a model as the planner counts it: parameters (total, active, per layer, the root's) and
what FP8 quantizes (the projection weights), from a Hugging Face ``config.json`` or a shipped name.

Attention is counted as the config says: ``head_dim`` where given (Qwen3's 32 heads of 128 over a hidden
size of 2048), q / k / v biases from ``attention_bias`` (else Qwen2's have them), Qwen3's per-head q / k
norms. A mixture of experts (``num_experts`` / ``num_local_experts`` / ``n_routed_experts``) counts every
expert's parameters (total, and the active ones a token reads). Not modelled, and said with a warning
(``unmodelled``): DeepSeek-V3's latent attention (MLA) and the dense MLP layers of an MoE model
(DeepSeek-V3's first three, Qwen-MoE's ``mlp_only_layers``): every layer is planned as an MoE layer.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["MODELS", "ModelShape", "load_shape", "unmodelled"]

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
    def projection_matrices(self) -> list[tuple[int, int, int]]:
        """One layer's projection weights as ``(out, in, how many)``: q, k, v, o, and the MLP's gate,
        up, down (every expert's, and the shared expert's)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = [(q, h, 1), (kv, h, 2), (h, q, 1)]
        if not self.experts:
            return [*attention, (self.intermediate, h, 2), (h, self.intermediate, 1)]
        mlp = [(self.expert_intermediate, h, 2 * self.experts), (h, self.expert_intermediate, self.experts)]
        if self.shared_intermediate:
            mlp += [(self.shared_intermediate, h, 2), (h, self.shared_intermediate, 1)]
        return attention + mlp

    @property
    def largest_param(self) -> int:
        """Elements of the largest parameter: the embedding, or a projection wider than it."""
        return max(self.vocab * self.hidden, *(n * k for n, k, _ in self.projection_matrices))

    @property
    def vector_params(self) -> int:
        """One-dimensional parameters of the whole model: RMSNorm weights, q / k / v biases."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = (
            2 * self.hidden
            + (q + 2 * kv if self.qkv_bias else 0)
            + (2 * self.head_dim if self.qk_norm else 0)
        )
        return self.layers * per_layer + self.hidden  # and the final norm

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
