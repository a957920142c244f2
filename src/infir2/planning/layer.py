"""One decoder layer's figures: activation bytes per token and weight-copy bytes (``layer_figures``).

Measured by ``planning.measure.layer_memory`` at the layer's shape (what ``infir2 memory`` prints),
and kept: the shipped shapes' GPU figures are embedded (``MEASURED``); any other shape, recipe or a
CPU run is measured when first asked for. An MoE layer: ``planning.moe``.
"""

from __future__ import annotations

import dataclasses

from .measure import layer_memory, safe_tokens
from .moe import moe_layer_figures
from .shape import ModelShape

__all__ = ["MEASURED", "MEASURED_CPU", "layer_figures"]

#: Per decoder layer (hidden, intermediate, heads, kv heads, SwiGLU recompute, RMSNorm recompute, the SwiGLU's
#: saved inputs in FP8) -> recipe ->
#: (activation bytes per token,
#: weight-copy bytes), as printed by ``infir2 memory --tokens 384`` (BENCHMARKS.md); other shapes are
#: measured on the fly by ``layer_figures`` (a head_dim other than hidden // heads: last in the key).
MEASURED: dict[tuple[int | bool, ...], dict[str, tuple[float, int]]] = {
    (1536, 8960, 12, 2, False, False, False): {
        "bf16": (118840, 93585408),
        "blockwise": (99552, 46804128),
        "blockwise_fp32scale": (99552, 46804128),
        "rowwise": (99269, 0),
        "tensorwise": (99128, 46792732),
    },
    (3584, 18944, 28, 4, False, False, False): {
        "bf16": (261240, 466092032),
        "blockwise": (218136, 233102912),
        "blockwise_fp32scale": (218136, 233102912),
        "rowwise": (217517, 0),
        "tensorwise": (217208, 233046044),
    },
    # with the SwiGLU recompute training applies by default (``infir2 memory``, same command, 2026-11-30)
    (1536, 8960, 12, 2, True, False, False): {
        "bf16": (100920, 93585408),
        "blockwise": (81632, 46804128),
        "blockwise_fp32scale": (81632, 46804128),
        "mxfp8": (81632, 0),
        "rowwise": (81349, 0),
        "tensorwise": (81208, 46792732),
    },
    (3584, 18944, 28, 4, True, False, False): {
        "bf16": (223352, 466092032),
        "blockwise": (180248, 233102912),
        # the shipped qwen2.5-7b-rl's recipe, as layer_figures measures it (2026-12-03): kept here so that
        # `infir2 rl` and `infir2 plan --rl` do not measure a 7B layer before they start
        "blockwise_fp32scale": (180248, 233159808),
        "mxfp8": (180248, 0),
        "tensorwise": (179320, 233046044),
    },
    # with the RMSNorm recompute as well (model.recompute_norm, on by default; ``infir2 memory``, same
    # command, 2026-12-07): each norm's normalized output no longer kept, 8 x hidden bytes per token less
    (1536, 8960, 12, 2, True, True, False): {
        "bf16": (88632, 93585408),
        "blockwise": (69344, 46815552),
        "blockwise_fp32scale": (69344, 46815552),
        "mxfp8": (69344, 0),
        "rowwise": (69061, 0),
        "tensorwise": (68920, 46792760),
    },
    (3584, 18944, 28, 4, True, True, False): {
        "bf16": (194680, 466092032),
        "blockwise": (151576, 233159808),
        "blockwise_fp32scale": (151576, 233159808),
        "mxfp8": (151576, 0),
        "tensorwise": (150648, 233046072),
    },
    # Qwen3-30B-A3B's layer at its active width (8 x 768; head_dim 128), SwiGLU recompute (layer_figures,
    # 2026-12-01)
    (2048, 6144, 32, 4, True, False, False, 128): {
        "bf16": (108680, 113246208),
        "blockwise": (90696, 56650752),
    },
    # and with the RMSNorm recompute (layer_memory at 640 tokens, 2026-12-07)
    (2048, 6144, 32, 4, True, True, False, 128): {
        "bf16": (92296, 113246208),
        "blockwise": (74312, 56650752),
    },
}

#: the same figures for a CPU run (``device="cpu"``), measured when first asked for
MEASURED_CPU: dict[tuple[int | bool, ...], dict[str, tuple[float, int]]] = {}


def active_width_layer(shape: ModelShape) -> ModelShape:
    """The dense layer an MoE layer is estimated from: the MLP of its active width (top-k experts and
    the shared one), plain attention of the same heads; a dense shape as it is, less its bias / norm
    flags (the measured layer is Qwen2's)."""
    return dataclasses.replace(
        shape,
        intermediate=shape.active_intermediate,
        experts=0,
        expert_intermediate=0,
        top_k=0,
        shared_intermediate=0,
        shared_gate=False,
        qkv_bias=True,
        qk_norm=False,
    )


def layer_figures(
    shape: ModelShape,
    recipe: str,
    recompute_mlp: bool = True,
    device: str = "cuda",
    recompute_norm: bool = True,
    mlp_saved_fp8: bool = False,
) -> tuple[float, int]:
    """(activation bytes per token, weight-copy bytes) of one decoder layer: measured, cached.
    ``MEASURED`` holds GPU figures; a CPU run's (fp32, no autocast) are measured on the fly.
    An MoE layer: the dense layer of its active width, then ``moe_layer_figures``."""
    dense = active_width_layer(shape)
    key: tuple[int | bool, ...] = (
        dense.hidden,
        dense.intermediate,
        dense.heads,
        dense.kv_heads,
        recompute_mlp,
        recompute_norm,
        mlp_saved_fp8,
    )
    if dense.head_dim != dense.hidden // dense.heads:
        key += (dense.head_dim,)  # heads of another width than hidden // heads: keyed apart
    table = MEASURED if device == "cuda" else MEASURED_CPU
    if recipe not in table.get(key, {}):
        heads = {dense.heads * dense.head_dim, dense.kv_heads * dense.head_dim}
        m = layer_memory(
            "",
            recipe,
            safe_tokens({dense.hidden, dense.intermediate, *heads}),
            recompute_mlp,
            device,
            recompute_norm,
            mlp_saved_fp8,
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
    return moe_layer_figures(shape, dense, recipe, per_token, weight_copy)
