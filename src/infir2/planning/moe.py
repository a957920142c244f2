"""The mixture-of-experts term: an MoE layer's figures from the dense layer of its active width.

A mixture of experts gathers every expert's weights (as FP8 codes with ``param_gather``), keeps every
expert's FP8 weight copy (until its layer's backward, as a dense layer's), and keeps activations
estimated from the dense layer of the active width (top-k experts + the shared one) plus the experts'
extra copies of each routed row: a lower bound (``tests/test_moe_plan.py``; tiny MoE models keep
25-35% more). Parameters and all-gather bytes are exact (``planning.shape``).
"""

from __future__ import annotations

from ..fp8 import RECIPES
from .inputs import BF16_BYTES
from .quantized import row_bytes
from .shape import ModelShape

__all__ = ["MOE_NOTE", "moe_layer_figures"]

#: what the plan of an MoE model says under its table
MOE_NOTE = (
    "mixture of experts: activations and weight copies estimated from a dense layer of the active "
    "width (a lower bound: tiny MoE models keep 25-35% more); parameters and all-gather bytes exact"
)


def moe_layer_figures(
    shape: ModelShape, dense: ModelShape, recipe: str, per_token: float, weight_copy: int
) -> tuple[float, int]:
    """(activation bytes per token, weight-copy bytes) of an MoE layer from those of ``dense`` (its
    active width): plus the k - 1 extra copies of each token's input the experts keep (one per routed
    row: the recipe's codes and scales, or bf16), weight copies scaled to all experts' weights (each expert's FP8 copy is
    saved for its layer's backward)."""
    r = RECIPES[recipe]  # an FP8 recipe's rows as the copy it saves for backward (x_wgrad): codes + scales
    row = row_bytes(r.x_wgrad, shape.hidden) if r.enabled else shape.hidden * BF16_BYTES
    per_token += (shape.top_k - 1) * row
    return per_token, round(weight_copy * shape.projection_weights / dense.projection_weights)
