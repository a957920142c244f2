"""GEMM and quantize backends (``emulated``: the torch reference; ``fast_emulated``: the same bits,
faster on CPU, with its C loop in ``native``; ``scaled_mm``: torch's FP8 GEMM; ``triton``; ``compiled``)
and the dispatcher that binds a recipe on a device to one fallback chain of them (``registry``)."""

from .operand import Nvfp4Operand, Operand
from .registry import BACKENDS, ORDER, Backend, Kernels, bind

__all__ = ["BACKENDS", "ORDER", "Backend", "Kernels", "Nvfp4Operand", "Operand", "bind"]
