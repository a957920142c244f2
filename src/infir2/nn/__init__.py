"""FP8 modules: ``Fp8Linear`` and the model conversion around it."""

from . import custom_ops as _custom_ops  # noqa: F401  (registers the torch.compile custom ops)
from . import moe_ops as _moe_ops  # noqa: F401  (and those of the FP8 experts)
from .convert import (
    DECODER_PROJECTIONS,
    cache_fp8_weights,
    convert_to_fp8,
    default_module_filter,
    disable_fp8,
    fp8_enabled,
    fp8_modules,
    fp8_weight_names,
    unrecognised_experts,
    why_high_precision,
)
from .linear import Fp8Linear
from .moe import Fp8Experts
from .swiglu import recompute_swiglu

__all__ = [
    "DECODER_PROJECTIONS",
    "Fp8Experts",
    "Fp8Linear",
    "cache_fp8_weights",
    "convert_to_fp8",
    "default_module_filter",
    "disable_fp8",
    "fp8_enabled",
    "fp8_modules",
    "fp8_weight_names",
    "recompute_swiglu",
    "unrecognised_experts",
    "why_high_precision",
]
