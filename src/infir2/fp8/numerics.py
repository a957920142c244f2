"""Numerical-quality measures used by tests and telemetry.

* SQNR (signal-to-quantization-noise ratio) in dB: ``20 log10(||ref|| / ||ref - x||)``, computed in
  fp64. 25 dB is the floor used in the field for an FP8 cast round trip and an FP8 linear layer.
* DeepGEMM's ``calc_diff = 1 - 2 sum(x y) / sum(x^2 + y^2)``: 0 for identical tensors; GEMM kernels
  are accepted below 1e-3.
"""

from __future__ import annotations

import torch

__all__ = ["calc_diff", "sqnr"]


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """SQNR of ``x`` against ``ref`` in dB (``inf`` when they are equal)."""
    ref64, x64 = ref.detach().double(), x.detach().double()
    noise = torch.linalg.vector_norm(ref64 - x64)
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(torch.linalg.vector_norm(ref64) / noise))


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity measure (0 = identical, 1 = unrelated)."""
    x64, y64 = x.detach().double(), y.detach().double()
    denominator = (x64 * x64 + y64 * y64).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x64 * y64).sum() / denominator)
