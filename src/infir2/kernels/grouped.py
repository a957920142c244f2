"""Grouped FP8 GEMMs: one block-scaled GEMM per group of rows (the experts of a mixture-of-experts layer).

A grouped GEMM multiplies the rows of ``A [S, K]`` that belong to group ``g`` (rows
``offsets[g] : offsets[g + 1]``, sorted by group) with that group's own ``B_g [N, K]``::

    Y[rows_g] = A[rows_g] @ B_g.T        [S_g, K] @ [K, N] -> [S_g, N], fp32 accumulate

Groups are uneven and may be empty (an expert no token was routed to: no rows, no GEMM). The
quantization follows the dense recipe per group: an operand tiled along the group's rows (1x128
activation tiles) or along its reduction over tokens (the 128x1 tiles of wgrad) is quantized from
that group's rows alone, so one 128-token tile never mixes experts; a weight is quantized per expert
(128x128 blocks of ``B_g``). Each group's GEMM is the dense GEMM of the bound
:class:`~infir2.kernels.registry.Kernels` -- the backend of the fallback chain that takes it -- so on a
CPU a grouped GEMM is, bit for bit, the loop over experts of the dense emulation (what the tests
check). On a GPU the same loop runs the dense kernels per expert (cuBLAS block-scaled ``scaled_mm``
on SM90, else Triton, else the emulation): correct, not yet one fused launch. torch's
``scaled_grouped_mm`` takes rowwise and MX scales, not 1x128 x 128x128 blocks, so it is not in the
chain; a fused blockwise grouped kernel would be one more branch of :func:`gemm_nt_grouped`. None
of the GPU path has run on a GPU yet.

On a CPU the emulations' GEMM is the fp32 matmul of the dequantized operands, and ``torch._grouped_mm``
runs that matmul for every group in one call over group offsets held on the device
(:func:`grouped_mm_nt`, :func:`grouped_mm_nn`, :func:`grouped_mm_tn`): it multiplies each group as ``torch.mm``
does, bit for bit (what ``tests/test_nn_moe.py`` checks against the loop), and needs no host read of
the group sizes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from ..fp8.recipe import Cast
from .operand import Operand
from .registry import Kernels

__all__ = [
    "cpu_grouped_mm",
    "gemm_nt_grouped",
    "group_bounds",
    "grouped_mm_nn",
    "grouped_mm_nt",
    "grouped_mm_tn",
    "quantize_pair_groups",
]

log = logging.getLogger(__name__)


def group_bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, end)]`` row ranges of groups with ``counts`` rows each (sorted by group)."""
    bounds, start = [], 0
    for count in counts:
        if count < 0:
            raise ValueError(f"group sizes must be >= 0, got {list(counts)}")
        bounds.append((start, start + count))
        start += count
    return bounds


def quantize_pair_groups(
    kernels: Kernels, x: torch.Tensor, bounds: Sequence[tuple[int, int]], a: Cast, b: Cast
) -> list[tuple[Operand, Operand] | None]:
    """Both tilings of each group of ``x [S, K]`` (one read where the backend fuses them)."""
    return [kernels.quantize_pair(x[s:e], a, b) if e > s else None for s, e in bounds]


def gemm_nt_grouped(
    kernels: Kernels,
    a: Sequence[Operand | None],
    b: Sequence[Operand],
    out_dtype: torch.dtype,
    like: torch.Tensor,
) -> torch.Tensor:
    """``cat_g(a[g] @ b[g].T)``: ``a[g] [S_g, K]`` (``None``: an empty group), ``b[g] [N, K]`` -> ``[S, N]``.

    ``like`` gives the device of the result (an all-empty grouping returns ``[0, N]``).
    """
    if len(a) != len(b):
        raise ValueError(f"grouped GEMM: {len(a)} groups of rows but {len(b)} weights")
    parts = [
        kernels.gemm_nt(a_g, b_g, out_dtype)  # [S_g,K] @ [K,N] -> [S_g,N], fp32 accumulate
        for a_g, b_g in zip(a, b, strict=True)
        if a_g is not None
    ]
    if not parts:
        return torch.zeros((0, b[0].shape[0]), dtype=out_dtype, device=like.device)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@functools.cache
def cpu_grouped_mm() -> bool:
    """Whether this torch runs ``torch._grouped_mm`` on fp32 CPU tensors (one small call, once); if not,
    the experts run the loop of dense GEMMs, said once in the log."""
    try:
        a, b = torch.ones(8, 4), torch.ones(2, 4, 4)
        torch._grouped_mm(a, b, offs=torch.tensor([4, 8], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        log.info(
            "torch._grouped_mm does not run on fp32 CPU tensors here (%s): the experts loop per expert", e
        )
        return False
    return True


def grouped_mm_nt(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``cat_g(a[rows_g] @ b[g].T)``: ``a [S, K]``, ``b [G, N, K]``, ``ends [G]`` int32 (each group's last
    row + 1, on the device) -> ``[S, N]``, in ``a``'s dtype."""
    return torch._grouped_mm(a, b.transpose(1, 2), offs=ends)  # per group [S_g,K] @ [K,N] -> [S_g,N]


def grouped_mm_nn(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``cat_g(a[rows_g] @ b[g])``: ``a [S, N]``, ``b [G, N, K]`` (row-major, as the dense GEMM reads
    ``B.T.T``: a column-major ``b`` sums a one-row group in another order) -> ``[S, K]``."""
    return torch._grouped_mm(a, b, offs=ends)  # per group [S_g,N] @ [N,K] -> [S_g,K]


def grouped_mm_tn(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``stack_g(a[rows_g].T @ b[rows_g])``: ``a [S, N]``, ``b [S, K]`` -> ``[G, N, K]`` (zero for an empty
    group), the reduction over each group's rows (the wgrad of the experts)."""
    return torch._grouped_mm(a.t(), b, offs=ends)  # per group [N,S_g] @ [S_g,K] -> [N,K]
