"""GEMM and quantize backends (emulated torch reference, torch scaled_mm, Triton, compiled) and the
dispatcher that binds a recipe on a device to one fallback chain of them."""

from .operand import Operand
from .registry import BACKENDS, ORDER, Backend, Kernels, bind

__all__ = ["BACKENDS", "ORDER", "Backend", "Kernels", "Operand", "bind"]
