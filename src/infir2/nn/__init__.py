"""FP8 modules and the whole-model switches around them.

``Fp8Module`` (``module``) is what every FP8 module shares: recipe, kernel binding, weight cache, registry
key, stats. ``Fp8Linear`` (``linear``, its ``torch.compile`` ops in ``custom_ops``) and ``Fp8Experts``
(the package ``moe``: the experts, their grouped linear, FSDP2 gather, telemetry, compile ops) subclass
it; ``convert`` swaps them into a model and switches FP8 on / off and the weight cache; ``fsdp`` gathers
FP8 weights under FSDP2; ``telemetry`` records FP8 numerics; ``swiglu``, ``norm`` and ``context_parallel``
are the memory and sequence-length helpers of the decoder layers.
"""

from . import custom_ops as _custom_ops  # noqa: F401  (registers the torch.compile custom ops)
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
from .moe import ops as _moe_ops  # noqa: F401  (and those of the FP8 experts)
from .norm import recompute_rmsnorm
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
    "recompute_rmsnorm",
    "recompute_swiglu",
    "unrecognised_experts",
    "why_high_precision",
]
