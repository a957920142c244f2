"""How the library's own products and sums accumulate, whatever runs them.

One rule for every place that writes a GEMM or a sum as torch code: the FP8 linears and experts (their
emulated GEMMs are fp32 products and sums of dequantized operands), context parallelism's attention and
the token scorer's logits. It lives with the numbers (``fp8/``) because it is a numerical rule, not a
module's: ``loss/`` and ``nn/`` read it alike.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

__all__ = ["accumulation_dtype", "no_autocast"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype products and sums accumulate in: fp32, or fp64 for fp64 tensors (``model.precision:
    fp64``, the CPU-independent reference)."""
    return torch.promote_types(dtype, torch.float32)


def no_autocast(device: torch.device) -> AbstractContextManager[Any]:
    """Autocast off on ``device`` for an FP8 function's body: its GEMMs are written as fp32 products and
    sums of dequantized operands, and under autocast a CPU ``a @ b`` of fp32 tensors would run as a bf16
    GEMM (a bf16 result, another kernel, on AVX2 another summation order and 7-300x slower)."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return nullcontext()
