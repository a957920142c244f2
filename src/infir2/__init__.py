"""infir2: a PyTorch-native FP8 training recipe (InfiR2 / DeepSeek-V3 hybrid granularity)."""

from .fp8 import RECIPES, Fp8Recipe, calc_diff, dequantize, get_recipe, quantize, sqnr
from .nn import Fp8Linear, cache_fp8_weights, convert_to_fp8, disable_fp8, fp8_enabled

__version__ = "0.1.0"

__all__ = [
    "RECIPES",
    "Fp8Linear",
    "Fp8Recipe",
    "__version__",
    "cache_fp8_weights",
    "calc_diff",
    "convert_to_fp8",
    "dequantize",
    "disable_fp8",
    "fp8_enabled",
    "get_recipe",
    "quantize",
    "sqnr",
]
