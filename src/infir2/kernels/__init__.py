"""GEMM and quantization backends: emulated (torch reference), torch scaled_mm, and fast GPU kernels."""

from .operand import Operand
from .registry import BACKENDS, Backend, register_backend, select_backend

__all__ = ["BACKENDS", "Backend", "Operand", "register_backend", "select_backend"]
