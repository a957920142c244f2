"""Named FP8 training recipes: how each operand of the three GEMMs of a linear layer is cast.

An ``nn.Linear`` ``Y = X @ W.T`` runs three GEMMs per step (X ``[T, K]`` tokens x input channels,
W ``[N, K]``, dY ``[T, N]``). A recipe is plain data: one :class:`Cast` per operand of each GEMM,
saying the block shape (in the operand's own orientation), the element format and how the block
scales are encoded. Each operand is quantized from its high-precision original:

===================  ==================  ===================  ===================  ====================
recipe               fprop X / W         dgrad dY / W         wgrad dY / X         scales
===================  ==================  ===================  ===================  ====================
blockwise            (1,128) / (128,128) (1,128) / (128,128)  (128,1) / (128,1)    pow2 (InfiR2, DSv3)
blockwise_fp32scale  same as blockwise                                             fp32 (RL)
blockwise_hybrid     same as blockwise, dY in E5M2 (dgrad and wgrad)                pow2 (TE's HYBRID)
mxfp8                (1,32) / (1,32)     (1,32) / (32,1)      (32,1) / (32,1)      E8M0, rounded up
nvfp4                (1,16) / (16,16)    (1,16) / (16,16)     (16,1) / (16,1)      E4M3 x fp32 tensor
nvfp4_4over6         same as nvfp4, X and W blocks mapped to 4 or 6 (the smaller error)
rowwise              (1,-1) / (1,-1)     (1,-1) / (-1,1)      (-1,1) / (-1,1)      pow2, one per row
tensorwise           (-1,-1) everywhere                                            fp32, one per tensor
bf16                 no FP8: a plain high-precision linear (the baseline)
===================  ==================  ===================  ===================  ====================

In every GEMM the blocks run along its reduction dimension: K in fprop, N in dgrad, T in wgrad.
E4M3 is used for every tensor, gradients included (docs/RECIPE.md), except in ``blockwise_hybrid``:
TransformerEngine's HYBRID format choice on the blockwise tiles -- E4M3 for activations and weights,
E5M2 (range to 57344, one mantissa bit fewer) for the output gradient dY, the one operand of dgrad and
of wgrad that comes from the loss. Its weights are E4M3, so it exports as ``blockwise`` does. ``mxfp8`` is OCP Microscaling
MXFP8 as Blackwell trains it: 32-element blocks along every reduction, one E8M0 scale per block.
``nvfp4`` is TransformerEngine's default NVFP4 recipe emulated exactly (``infir2.fp8.nvfp4``): E2M1
elements in every GEMM, one E4M3 scale per 16 elements under one fp32 scale per tensor, 16x16 blocks
for the weight, stochastic rounding of dY (both copies), and the 16-point random Hadamard transform
on both wgrad operands (dY and X, along tokens; ``(H dY)^T (H X) = dY^T X``). It claims numerics only:
the GEMMs run on the dequantized operands (no FP4 tensor cores on Hopper).

A recipe name is checked by ``get_recipe`` (the one check, wherever a name arrives: a config, a
command's option) and turned into its ``Fp8Recipe`` where a model is converted (``convert_to_fp8``;
``harness.setup`` does it once per run for the model and the FSDP2 gather); the modules and kernels
below only read its casts, never a name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .formats import BLOCK, E2M1, FORMATS, MX_BLOCK, NVFP4_BLOCK, get_format
from .nvfp4 import ROUNDINGS
from .quantize import Block, ScaleEncoding, resolve_block, resolve_encoding

__all__ = ["RECIPES", "SAME_RECIPE", "Cast", "Fp8Recipe", "get_recipe", "recipe_names"]

TILE: Block = (1, BLOCK)  # 1x128: per token, 128 channels
TOKEN_TILE: Block = (BLOCK, 1)  # 128x1: 128 tokens, one channel
WEIGHT_BLOCK: Block = (BLOCK, BLOCK)
ROW: Block = (1, -1)
COLUMN: Block = (-1, 1)
TENSOR: Block = (-1, -1)
MX_ROW: Block = (1, MX_BLOCK)  # 1x32 along the reduction dimension of a row-major operand
MX_COLUMN: Block = (MX_BLOCK, 1)  # 32x1: the same for an operand the GEMM reads transposed
NV_ROW: Block = (1, NVFP4_BLOCK)  # 1x16 along the reduction dimension (NVFP4 activations, gradients)
NV_COLUMN: Block = (NVFP4_BLOCK, 1)  # 16x1: along tokens, for the wgrad operands
NV_WEIGHT: Block = (NVFP4_BLOCK, NVFP4_BLOCK)  # 16x16: one quantized weight for fprop and dgrad


@dataclass(frozen=True)
class Cast:
    """How one GEMM operand becomes FP8 (or NVFP4): ``block`` (rows, cols; -1 = whole dimension),
    element ``fmt`` (``e4m3`` / ``e5m2``, or ``e2m1``) and ``scale_encoding`` (``fp32``, ``pow2`` or
    ``e8m0``: the scale rules of ``infir2.fp8.quantize``).

    ``fmt="e2m1"`` is NVFP4 (``infir2.fp8.nvfp4``): E4M3 block scales under one fp32 scale per tensor,
    so its ``scale_encoding`` is ``fp32`` (the tensor scale) and its block one of 1x16, 16x1, 16x16.
    Three options exist for it alone: ``rounding`` (``nearest`` or ``stochastic``), ``hadamard``
    (the 16-point random Hadamard transform along the block's 16 elements before the cast) and
    ``four_over_six`` (each block mapped to 4 or to 6, whichever errs less: ``quantize_nvfp4``).
    """

    block: Block
    fmt: str = "e4m3"
    scale_encoding: ScaleEncoding = "pow2"
    rounding: str = "nearest"
    hadamard: bool = False
    four_over_six: bool = False

    def __post_init__(self) -> None:
        resolve_block(self.block, (1, 1))
        resolve_encoding(self.scale_encoding)
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"unknown rounding {self.rounding!r}; expected one of {ROUNDINGS}")
        if self.fmt != E2M1.name:
            get_format(self.fmt)
            if self.rounding != "nearest" or self.hadamard or self.four_over_six:
                raise ValueError(
                    f"rounding / hadamard / four_over_six options are for e2m1 (NVFP4) casts, not {self.fmt}"
                )
            return
        if tuple(self.block) not in (NV_ROW, NV_COLUMN, NV_WEIGHT) or self.scale_encoding != "fp32":
            raise ValueError(
                f"an e2m1 (NVFP4) cast has block {NV_ROW}, {NV_COLUMN} or {NV_WEIGHT} and scale_encoding "
                f"'fp32' (E4M3 block scales under an fp32 tensor scale), got {self.block} {self.scale_encoding!r}"
            )
        if self.four_over_six and self.rounding != "nearest":
            raise ValueError(
                "four_over_six picks a block scale by the round-to-nearest error: rounding 'nearest'"
            )
        if self.hadamard and tuple(self.block) != NV_COLUMN:
            raise ValueError(
                "the random Hadamard transform runs along tokens: only a (16, 1) e2m1 cast takes it"
            )

    @property
    def is_fp4(self) -> bool:
        """True for an NVFP4 (E2M1) cast. Outside ``fp8/`` and ``kernels/`` read what it means instead:
        the byte counts below, or a recipe's capabilities (``Fp8Recipe.compiles`` and the rest)."""
        return self.fmt == E2M1.name

    @property
    def code_bytes(self) -> float:
        """Bytes per element of the quantized codes: 0.5 for E2M1 (two a byte), 1 for an FP8 format."""
        return 0.5 if self.is_fp4 else 1.0

    @property
    def block_scale_bytes(self) -> int:
        """Bytes per block scale: 1 for an E4M3 scale (NVFP4) or an E8M0 one, else 4 (fp32 / pow2)."""
        return 1 if self.is_fp4 or self.scale_encoding == "e8m0" else 4

    @property
    def tensor_scale_bytes(self) -> int:
        """Bytes of the one scale per tensor above the block scales: 4 (fp32) for NVFP4, else none."""
        return 4 if self.is_fp4 else 0


@dataclass(frozen=True)
class Fp8Recipe:
    """The cast of each operand of the fprop, dgrad and wgrad GEMMs (blocks in operand orientation).

    ``enabled=False`` is the high-precision baseline (``bf16``): no GEMM runs in FP8.
    """

    name: str
    x: Cast = Cast(TILE)  # X [T, K], fprop A
    w: Cast = Cast(WEIGHT_BLOCK)  # W [N, K], fprop B
    dy: Cast = Cast(TILE)  # dY [T, N], dgrad A
    w_dgrad: Cast = Cast(WEIGHT_BLOCK)  # W [N, K], dgrad B (read transposed)
    dy_wgrad: Cast = Cast(TOKEN_TILE)  # dY [T, N], wgrad A (read transposed)
    x_wgrad: Cast = Cast(TOKEN_TILE)  # X [T, K], wgrad B (read transposed); the copy saved for backward
    enabled: bool = True

    @property
    def casts(self) -> dict[str, Cast]:
        """The six casts by operand name."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Cast)
        }

    @property
    def reuses_weight(self) -> bool:
        """True when dgrad can reuse the fprop-quantized weight (same cast)."""
        return self.w == self.w_dgrad

    @property
    def gathers_fp8_weight(self) -> bool:
        """True when the weight can be all-gathered as FP8 codes under FSDP2 (``fp8.param_gather``):
        the GEMMs read it only through one quantized copy (fprop and dgrad use the same cast), and the
        copy is FP8 (an NVFP4 weight needs its whole tensor's amax: gathered in high precision)."""
        return self.enabled and self.reuses_weight and self.w.fmt in FORMATS

    @property
    def param_gather_default(self) -> bool:
        """What ``fp8.param_gather: null`` means: on where the weight is gathered in blocks (128x128),
        off for one scale per tensor (the gather would need the whole tensor's amax first) and where
        :attr:`gathers_fp8_weight` is False."""
        return self.gathers_fp8_weight and all(b > 0 for b in self.w.block)

    @property
    def k_major_dgrad_weight(self) -> bool:
        """True when, on CUDA, dgrad reads a K-major copy of the fprop weight's transpose: fprop and dgrad
        share one quantized weight and it is FP8 (NVFP4 runs on dequantized operands on every device: no
        FP4 GEMM reads a K-major copy)."""
        return self.reuses_weight and not self.w.is_fp4

    @property
    def compiles(self) -> bool:
        """True when ``Fp8Linear`` runs under ``torch.compile`` (its custom op is written): FP8 recipes;
        NVFP4's runs eager only."""
        return not self.x.is_fp4

    @property
    def runs_experts(self) -> bool:
        """True when the routed experts' grouped GEMMs take this recipe (``Fp8Experts``): every cast FP8.
        NVFP4 runs dense linears only."""
        return not any(c.is_fp4 for c in self.casts.values())

    @property
    def has_telemetry(self) -> bool:
        """True when the FP8 telemetry (``fp8.stats_every``) can read this recipe's operands: it reads FP8
        codes, so not where an operand is E2M1 (NVFP4)."""
        return not any(c.is_fp4 for c in self.casts.values())

    def param_gather(self, setting: bool | None) -> bool:
        """Whether FSDP2 all-gathers the weights as FP8 codes for a ``fp8.param_gather`` setting."""
        return self.gathers_fp8_weight and (self.param_gather_default if setting is None else setting)


def _encoded(name: str, scale_encoding: ScaleEncoding, *blocks: Block) -> Fp8Recipe:
    """An E4M3 recipe whose six casts share ``scale_encoding``: ``blocks`` in field order (x, w, dy,
    w_dgrad, dy_wgrad, x_wgrad), or one block for all six."""
    x, w, dy, w_dgrad, dy_wgrad, x_wgrad = (
        Cast(block, scale_encoding=scale_encoding) for block in (blocks * 6 if len(blocks) == 1 else blocks)
    )
    return Fp8Recipe(name, x, w, dy, w_dgrad, dy_wgrad, x_wgrad)


RECIPES: dict[str, Fp8Recipe] = {
    "bf16": Fp8Recipe("bf16", enabled=False),
    "blockwise": Fp8Recipe("blockwise"),
    "blockwise_fp32scale": _encoded(
        "blockwise_fp32scale", "fp32", TILE, WEIGHT_BLOCK, TILE, WEIGHT_BLOCK, TOKEN_TILE, TOKEN_TILE
    ),
    "blockwise_hybrid": Fp8Recipe(
        "blockwise_hybrid", dy=Cast(TILE, fmt="e5m2"), dy_wgrad=Cast(TOKEN_TILE, fmt="e5m2")
    ),
    "mxfp8": _encoded("mxfp8", "e8m0", MX_ROW, MX_ROW, MX_ROW, MX_COLUMN, MX_COLUMN, MX_COLUMN),
    "rowwise": _encoded("rowwise", "pow2", ROW, ROW, ROW, COLUMN, COLUMN, COLUMN),
    "tensorwise": _encoded("tensorwise", "fp32", TENSOR),
    # TransformerEngine's NVFP4BlockScaling: E2M1 everywhere, RNE for X and W, stochastic rounding for
    # dY, the random Hadamard transform on both wgrad operands (along tokens), 16x16 weight blocks
    "nvfp4": Fp8Recipe(
        "nvfp4",
        Cast(NV_ROW, E2M1.name, "fp32"),
        Cast(NV_WEIGHT, E2M1.name, "fp32"),
        Cast(NV_ROW, E2M1.name, "fp32", rounding="stochastic"),
        Cast(NV_WEIGHT, E2M1.name, "fp32"),
        Cast(NV_COLUMN, E2M1.name, "fp32", rounding="stochastic", hadamard=True),
        Cast(NV_COLUMN, E2M1.name, "fp32", hadamard=True),
    ),
    # nvfp4 with the "4 over 6" block-scale choice on its round-to-nearest casts (X and W, both copies)
    "nvfp4_4over6": Fp8Recipe(
        "nvfp4_4over6",
        Cast(NV_ROW, E2M1.name, "fp32", four_over_six=True),
        Cast(NV_WEIGHT, E2M1.name, "fp32", four_over_six=True),
        Cast(NV_ROW, E2M1.name, "fp32", rounding="stochastic"),
        Cast(NV_WEIGHT, E2M1.name, "fp32", four_over_six=True),
        Cast(NV_COLUMN, E2M1.name, "fp32", rounding="stochastic", hadamard=True),
        Cast(NV_COLUMN, E2M1.name, "fp32", hadamard=True, four_over_six=True),
    ),
    # the null control: the FP8 code path with exact casts -- every element its own block with an fp32
    # scale, so its E4M3 code is +-448 and the value survives to fp32 rounding (~1e-7 per GEMM). A run
    # of it is the baseline perturbed by rounding alone: the noise floor an FP8 gap must beat.
    "fp8_exact": _encoded("fp8_exact", "fp32", (1, 1)),
}


#: the training recipe whose GEMMs an FP8 export's weights (``infir2 export --scale-encoding``) compute:
#: the one map from a scale encoding to a recipe (RL rollouts, TIS's "same numerics" test, serving)
SAME_RECIPE = {"pow2": "blockwise", "fp32": "blockwise_fp32scale"}


def get_recipe(recipe: str | Fp8Recipe, **cast_overrides: object) -> Fp8Recipe:
    """A named recipe; ``cast_overrides`` (``fmt=``, ``scale_encoding=``) replace that field in every cast.

    The one check of a recipe name: an unknown one is a ``ValueError`` listing the known recipes.
    """
    unknown = set(cast_overrides) - {f.name for f in fields(Cast)}
    if unknown:
        raise ValueError(
            f"get_recipe: no cast field {', '.join(sorted(unknown))} "
            f"(the fields: {', '.join(f.name for f in fields(Cast))})"
        )
    if isinstance(recipe, Fp8Recipe):
        base = recipe
    elif recipe in RECIPES:
        base = RECIPES[recipe]
    else:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; known recipes: {', '.join(RECIPES)}")
    if not cast_overrides:
        return base
    casts = {name: replace(cast, **cast_overrides) for name, cast in base.casts.items()}  # type: ignore[arg-type]
    return replace(base, **casts)  # type: ignore[arg-type]


def recipe_names(text: str, option: str = "--recipes") -> list[str]:
    """A comma-separated list of recipe names (a command's option), each checked by ``get_recipe``; an
    empty list, a name given twice or an unknown name is a ``ValueError`` naming ``option``."""
    names = [r.strip() for r in text.split(",") if r.strip()]
    if not names:
        raise ValueError(f"{option}: an empty list; known recipes: {', '.join(RECIPES)}")
    if repeated := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"{option}: recipe {', '.join(repeated)} given twice; name each recipe once")
    for name in names:
        try:
            get_recipe(name)
        except ValueError as e:
            raise ValueError(f"{option}: {e}") from None
    return names
