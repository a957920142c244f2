"""The experts' grouped GEMMs as benchmarks run them: shapes, a routing, FP8 and bf16 projections.

One MoE MLP on one GPU is two grouped projections over ``S`` routed rows (sorted by expert,
``counts[e]`` rows for expert ``e``): gate_up ``[S, H] -> [S, 2I]`` through ``[E, 2I, H]`` and down
``[S, I] -> [S, H]`` through ``[E, H, I]``. The FP8 side is ``infir2.nn.moe.fp8_grouped_linear``
(each expert's rows through the dense blockwise recipe on the bound kernels); the bf16 side is
torch's ``grouped_mm`` where this torch has it (and it takes the operands), else a loop of bf16
``mm`` per expert. The row counts are given as Python ints here: inside a model ``Fp8Experts`` reads
them from the device once per MoE block (``# MoE routing:`` in ``infir2.nn.moe``).

Used by ``benchmarks/moe_grouped.py`` and the ``moe`` phase of ``benchmarks/gpu_bench.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...fp8 import get_recipe
from ...kernels import Kernels
from ...kernels.grouped import group_bounds
from ...nn.moe import fp8_grouped_linear

__all__ = [
    "MOE_GPU_SHAPES",
    "MoeShape",
    "bf16_grouped_mm",
    "grouped_projection",
    "mlp_step",
    "routed_counts",
]


@dataclass(frozen=True)
class MoeShape:
    """The experts of one MoE MLP on one GPU: hidden ``H``, expert width ``I``, ``experts`` held, and
    the ``rows`` routed to them per micro-batch (tokens x top-k, shared among the GPUs of an expert-
    parallel group)."""

    label: str
    hidden: int
    inter: int
    experts: int
    rows: int

    @property
    def flops(self) -> int:
        """One MLP's forward + backward: 3 GEMMs (fprop, dgrad, wgrad) of 2 S H (2I + I) each."""
        return 3 * 2 * self.rows * self.hidden * 3 * self.inter


#: 8192 tokens x top-8 per GPU. DeepSeek-V3 (hidden 7168, expert width 2048, 256 experts, top-8): a
#: GPU's 32 experts under 8-way expert parallelism, its 65536 rows; Qwen3-30B-A3B (2048 / 768, 128
#: experts, top-8): every expert on each GPU.
MOE_GPU_SHAPES = (
    MoeShape("deepseek-v3 EP8", 7168, 2048, 32, 65536),
    MoeShape("qwen3-30b-a3b", 2048, 768, 128, 65536),
)


def routed_counts(rows: int, experts: int, seed: int = 0, empty: bool = True) -> list[int]:
    """Rows per expert of a uniform random routing (uneven); with ``empty`` the last expert gets none
    (its rows go to the first), as an expert no token chose."""
    ids = torch.randint(0, experts, (rows,), generator=torch.Generator().manual_seed(seed))
    counts: list[int] = torch.bincount(ids, minlength=experts).tolist()
    if empty and experts > 1:
        counts[0], counts[-1] = counts[0] + counts[-1], 0
    return counts


def bf16_grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, str]:
    """``cat_e(x[rows_e] @ w[e].T)`` in bf16, and which implementation ran (``grouped_mm`` / ``mm loop``)."""
    grouped = getattr(torch.nn.functional, "grouped_mm", None)
    if grouped is not None:
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        try:
            return grouped(x, w.transpose(-2, -1), offs=offs), "grouped_mm"
        except (RuntimeError, NotImplementedError):  # an architecture or layout it does not take
            pass
    parts = [x[s:e] @ w[g].t() for g, (s, e) in enumerate(group_bounds(counts))]
    return torch.cat(parts), "mm loop"


def grouped_projection(
    x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, counts: list[int], kernels: Kernels | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """``(y, dx, dw, implementation)`` of one grouped projection: FP8 blockwise on ``kernels``, or bf16
    (``kernels=None``: operands cast to bf16). ``x [S, K]``, ``w [E, N, K]`` fp32, ``dy [S, N]``."""
    if kernels is None:
        xi, wi = x.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
        y, impl = bf16_grouped_mm(xi, wi, counts)
        y.backward(dy.to(torch.bfloat16))
    else:
        xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y, impl = fp8_grouped_linear(xi, wi, counts, get_recipe("blockwise"), kernels), kernels.name
        y.backward(dy.to(y.dtype))
    assert xi.grad is not None and wi.grad is not None
    return y.detach(), xi.grad, wi.grad, impl


def mlp_step(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: list[int], kernels: Kernels | None
) -> None:
    """One MoE MLP's forward + backward (gate_up, ``silu(gate) * up``, down): FP8 on ``kernels``, or bf16
    (``kernels=None``, ``w1`` / ``w2`` already bf16). Gradients accumulate in the leaves."""

    def project(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if kernels is None:
            return bf16_grouped_mm(a, w, counts)[0]
        return fp8_grouped_linear(a, w, counts, get_recipe("blockwise"), kernels)

    gate, up = project(x, w1).chunk(2, dim=-1)
    y = project((torch.nn.functional.silu(gate) * up).contiguous(), w2)
    y.float().sum().backward()
