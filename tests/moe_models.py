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


def moe_config(family: str):
    from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **_COMMON,
            intermediate_size=256,
            moe_intermediate_size=128,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=64,
        )
    if family == "qwen2_moe":
        return Qwen2MoeConfig(
            **_COMMON,
            intermediate_size=256,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            num_experts=4,
            num_experts_per_tok=2,
        )
    if family == "mixtral":
        return MixtralConfig(**_COMMON, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
    if family == "deepseek_v3":
        return DeepseekV3Config(
            **{**_COMMON, "num_key_value_heads": 2},
            intermediate_size=256,
            moe_intermediate_size=128,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            q_lora_rank=None,
            kv_lora_rank=64,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            n_shared_experts=1,
        )
    raise ValueError(f"unknown MoE family {family!r}; known: {', '.join(FAMILIES)}")


def make_tiny_moe(family: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(moe_config(family)).float()
