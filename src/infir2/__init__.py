"""infir2: a PyTorch-native FP8 training recipe (InfiR2 / DeepSeek-V3 hybrid granularity).

The names below are imported on first use (PEP 562 ``__getattr__``), so ``import infir2`` -- and the
``infir2`` command's ``--help`` / ``--version`` -- does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: public name -> the subpackage that defines it
_LAZY = {
    **dict.fromkeys(
        ("RECIPES", "Fp8Recipe", "calc_diff", "dequantize", "get_recipe", "quantize", "sqnr"), ".fp8"
    ),
    **dict.fromkeys(
        ("Fp8Linear", "cache_fp8_weights", "convert_to_fp8", "disable_fp8", "fp8_enabled"), ".nn"
    ),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
