"""Named FP8 training recipes: which block shape quantizes each operand of the three GEMMs.

An ``nn.Linear`` ``Y = X @ W.T`` runs three GEMMs per step (X ``[T, K]`` tokens x input channels,
W ``[N, K]``, dY ``[T, N]``). Each operand is quantized from its high-precision original with the
block shape the recipe names, given in the operand's own orientation:

============  ==================  ===================  ===================  =========================
recipe        fprop X / W         dgrad dY / W         wgrad dY / X         notes
============  ==================  ===================  ===================  =========================
blockwise     (1,128) / (128,128) (1,128) / (128,128)  (128,1) / (128,1)    InfiR2 / DeepSeek-V3, pow2
blockwise_fp32scale  same as blockwise                                      scales not rounded (RL)
rowwise       (1,-1) / (1,-1)     (1,-1) / (-1,1)      (-1,1) / (-1,1)      one scale per row along K
tensorwise    (-1,-1) everywhere                                            one scale per tensor
bf16          no FP8: a plain high-precision linear (the baseline)
============  ==================  ===================  ===================  =========================

In every GEMM the blocks run along its reduction dimension: K in fprop, N in dgrad, T in wgrad.
E4M3 is used for every tensor, gradients included (RECIPE.md section 1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .formats import BLOCK, get_format
from .quantize import Block, resolve_block

__all__ = ["RECIPES", "Fp8Recipe", "get_recipe"]

TILE: Block = (1, BLOCK)  # 1x128: per token, 128 channels
TOKEN_TILE: Block = (BLOCK, 1)  # 128x1: 128 tokens, one channel
WEIGHT_BLOCK: Block = (BLOCK, BLOCK)
ROW: Block = (1, -1)
COLUMN: Block = (-1, 1)
TENSOR: Block = (-1, -1)


@dataclass(frozen=True)
class Fp8Recipe:
    """How each operand of the fprop, dgrad and wgrad GEMMs is quantized (blocks in operand orientation)."""

    name: str
    enabled: bool = True
    fmt: str = "e4m3"
    grad_fmt: str = "e4m3"
    pow2_scale: bool = True
    input_block: Block = TILE  # X [T, K], fprop
    weight_block: Block = WEIGHT_BLOCK  # W [N, K], fprop
    grad_output_block: Block = TILE  # dY [T, N], dgrad
    dgrad_weight_block: Block = WEIGHT_BLOCK  # W [N, K], dgrad
    wgrad_grad_output_block: Block = TOKEN_TILE  # dY [T, N], wgrad
    wgrad_input_block: Block = TOKEN_TILE  # X [T, K], wgrad

    def __post_init__(self) -> None:
        get_format(self.fmt)
        get_format(self.grad_fmt)
        for field in (
            "input_block",
            "weight_block",
            "grad_output_block",
            "dgrad_weight_block",
            "wgrad_grad_output_block",
            "wgrad_input_block",
        ):
            resolve_block(getattr(self, field), (1, 1))

    @property
    def blocks(self) -> dict[str, tuple[Block, Block]]:
        return {
            "fprop": (self.input_block, self.weight_block),
            "dgrad": (self.grad_output_block, self.dgrad_weight_block),
            "wgrad": (self.wgrad_grad_output_block, self.wgrad_input_block),
        }

    @property
    def granularity(self) -> str:
        """``tensorwise``, ``rowwise`` or ``blockwise``: what kind of scales the GEMMs consume."""
        blocks = {b for pair in self.blocks.values() for b in pair}
        if blocks == {TENSOR}:
            return "tensorwise"
        if blocks <= {ROW, COLUMN}:
            return "rowwise"
        return "blockwise"

    @property
    def reuses_weight(self) -> bool:
        """True when dgrad can reuse the fprop-quantized weight (same blocks)."""
        return self.weight_block == self.dgrad_weight_block


RECIPES: dict[str, Fp8Recipe] = {
    "bf16": Fp8Recipe("bf16", enabled=False),
    "blockwise": Fp8Recipe("blockwise"),
    "blockwise_fp32scale": Fp8Recipe("blockwise_fp32scale", pow2_scale=False),
    "rowwise": Fp8Recipe(
        "rowwise",
        input_block=ROW, weight_block=ROW,
        grad_output_block=ROW, dgrad_weight_block=COLUMN,
        wgrad_grad_output_block=COLUMN, wgrad_input_block=COLUMN,
    ),
    "tensorwise": Fp8Recipe(
        "tensorwise", pow2_scale=False,
        input_block=TENSOR, weight_block=TENSOR,
        grad_output_block=TENSOR, dgrad_weight_block=TENSOR,
        wgrad_grad_output_block=TENSOR, wgrad_input_block=TENSOR,
    ),
}  # fmt: skip


def get_recipe(recipe: str | Fp8Recipe, **overrides: object) -> Fp8Recipe:
    """Look up a named recipe (optionally overriding fields, e.g. ``pow2_scale=False``)."""
    if isinstance(recipe, Fp8Recipe):
        base = recipe
    elif recipe in RECIPES:
        base = RECIPES[recipe]
    else:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; known recipes: {', '.join(RECIPES)}")
    return replace(base, **overrides) if overrides else base  # type: ignore[arg-type]
