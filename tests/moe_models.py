"""Tiny transformers v5 mixture-of-experts models from ``from_config`` (no download), one per family.

Two layers, four experts (top-2), hidden 128 and expert width 128: every GEMM of more than 128
rows has whole 128-row blocks (DeepSeek-V3's attention widths too), which transformers' CPU
dequantizer of the FP8 export needs (it takes the block size from weight rows / scale rows).
"""

from __future__ import annotations

import torch

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")

_COMMON = dict(
    vocab_size=256,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


#: the routed-expert shape of the families whose config has ``moe_intermediate_size``
_MOE = dict(intermediate_size=256, moe_intermediate_size=128, num_experts_per_tok=2)

#: per family: the transformers config class and its keys over ``_COMMON``
_FAMILY_CONFIG = {
    "qwen3_moe": ("Qwen3MoeConfig", {**_MOE, "num_experts": 4, "head_dim": 64}),
    "qwen2_moe": ("Qwen2MoeConfig", {**_MOE, "num_experts": 4, "shared_expert_intermediate_size": 128}),
    "mixtral": (
        "MixtralConfig",
        {"intermediate_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            **_MOE,
            "num_key_value_heads": 2,
            "n_routed_experts": 4,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 0,
            "q_lora_rank": None,
            "kv_lora_rank": 64,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            "n_shared_experts": 1,
        },
    ),
}
assert tuple(_FAMILY_CONFIG) == FAMILIES


def moe_config(family: str):
    import transformers

    if family not in _FAMILY_CONFIG:
        raise ValueError(f"unknown MoE family {family!r}; known: {', '.join(FAMILIES)}")
    config_name, keys = _FAMILY_CONFIG[family]
    return getattr(transformers, config_name)(**{**_COMMON, **keys})


def make_tiny_moe(family: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(moe_config(family)).float()


def qwen3_30b_a3b_config():
    """The transformers config of Qwen3-30B-A3B from the planner's shipped fields (its config.json's)."""
    from transformers import Qwen3MoeConfig

    from infir2.planning import MODELS

    return Qwen3MoeConfig(**{k: v for k, v in MODELS["qwen3-30b-a3b"].items() if k != "model_type"})


def make_unrecognised_moe(vocab_size: int = 256, seed: int = 0) -> torch.nn.Module:
    """A tiny Llama-4 text model: 3-D expert weights in a layout ``Fp8Experts`` does not run
    (``gate_up_proj`` ``(E, H, 2I)``), so ``convert_to_fp8`` leaves its experts high precision."""
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    torch.manual_seed(seed)
    config = Llama4TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        max_position_embeddings=512,
    )
    return AutoModelForCausalLM.from_config(config).float()
