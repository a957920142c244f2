"""FP8 numerics: formats, block-scaled quantization (the reference), recipes, quality measures.

"FP8" names the low-precision path: NVFP4's E2M1 (``nvfp4.py``) lives here too, and ``Fp8Linear`` runs
it (docs/ARCHITECTURE.md, "Names")."""

from .formats import BLOCK, FORMATS, Fp8Format, get_format
from .numerics import calc_diff, sqnr
from .quantize import Block, amax_to_scale, dequantize, quantize, resolve_block
from .recipe import RECIPES, SAME_RECIPE, Fp8Recipe, get_recipe, recipe_names

__all__ = [
    "BLOCK",
    "FORMATS",
    "RECIPES",
    "SAME_RECIPE",
    "Block",
    "Fp8Format",
    "Fp8Recipe",
    "amax_to_scale",
    "calc_diff",
    "dequantize",
    "get_format",
    "get_recipe",
    "quantize",
    "recipe_names",
    "resolve_block",
    "sqnr",
]
