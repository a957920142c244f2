"""The grouped linear of the experts over device offsets: no host read of the rows per expert.

``fp8_grouped_linear`` loops over experts with each expert's row count on the host. On a CPU
emulation (its GEMM is the fp32 matmul of the dequantized operands) the same numerics run with the
counts left on the device, in one call per quantization and per GEMM::

    fprop  Y  = grouped_mm_nt(deq(Q(X, 1x128)), deq(Q(W_e)), ends)       [S,K] @ [E: K,N] -> [S,N]
    dgrad  dX = grouped_mm_nn(deq(Q(dY, 1x128)), deq(Q(W_e)), ends)      [S,N] @ [E: N,K] -> [S,K]
    wgrad  dW = grouped_mm_tn(deq(Q(pad(dY), 128x1)), deq(Q(pad(X), 128x1)), ends)   -> [E,N,K]

A 1x128 tile lies in one row, so all experts' rows quantize in one call to the codes and scales of
the per-expert calls. A 128x1 tile runs along tokens and must not mix experts: each expert's rows
are placed at a multiple of 128 in a zero-padded buffer of static size (``TokenTiles``; the offsets are
computed on the device) and quantized in one call there; zero rows change no tile's amax, so every
real row gets the codes and scales it gets alone. Backward keeps the codes of the real rows only
(the bytes of the loop) and the padded buffer's tile scales. ``torch._grouped_mm`` multiplies each
group as ``torch.mm`` does, so the results are the loop's bit for bit (``tests/test_nn_moe.py``
compares the two paths: outputs, gradients and the saved FP8 codes).

Where it runs (``runs_on_offsets``): a CPU emulation chain, activation casts of one row per tile,
wgrad casts of whole token tiles of one size, fp32 / bf16 (``torch._grouped_mm`` takes no fp64), no
telemetry recorder (stats steps take the loop, which reports per expert). Elsewhere -- the GPU
backends, whose blockwise FP8 GEMMs have no grouped form yet -- the loop runs, counts read once a block.
"""

from __future__ import annotations

from typing import Any

import torch

from ...fp8.recipe import Fp8Recipe
from ...kernels import Kernels, Operand
from ...kernels.grouped import cpu_grouped_mm, grouped_mm_nn, grouped_mm_nt, grouped_mm_tn
from .grouped_linear import _dgrad_weights

__all__ = ["TokenTiles", "fp8_grouped_linear_offsets", "runs_on_offsets"]

#: the CPU backends whose GEMM is the fp32 matmul of dequantized operands
EMULATIONS = ("emulated", "fast_emulated")


def runs_on_offsets(recipe: Fp8Recipe, kernels: Kernels, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the experts' grouped linear runs over device offsets here (module doc)."""
    bm = recipe.x_wgrad.block[0]
    return (
        kernels.device.type == "cpu"
        and all(b.NAME in EMULATIONS for b in kernels.chain)
        and recipe.x.block[0] == 1
        and recipe.dy.block[0] == 1
        and bm > 0
        and recipe.dy_wgrad.block[0] == bm
        and recipe.runs_experts
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and x.shape[0] > 0
        and cpu_grouped_mm()
    )


class TokenTiles:
    """Where each of ``S`` rows sorted by expert (``counts [E]`` on the device) lies in a zero-padded
    buffer that starts every expert at a multiple of ``bm`` rows: ``dest [S]``, all on the device."""

    def __init__(self, counts: torch.Tensor, bm: int, rows: int) -> None:
        experts = counts.shape[0]
        self.rows, self.bm = rows, bm
        self.size = -(-(rows + experts * (bm - 1)) // bm) * bm  # static: the most any routing needs
        padded = (counts + bm - 1) // bm * bm
        expert = torch.repeat_interleave(
            torch.arange(experts, device=counts.device), counts, output_size=rows
        )  # [S] each row's expert
        first_row = (counts.cumsum(0) - counts)[expert]
        self.dest = (padded.cumsum(0) - padded)[expert] + torch.arange(rows, device=counts.device) - first_row

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """``t [S, C]`` -> ``[size, C]``, each row at its place, zeros between experts."""
        if self.bm == 1:
            return t
        return t.new_zeros((self.size, t.shape[1])).index_copy_(0, self.dest, t)

    def real(self, data: torch.Tensor) -> torch.Tensor:
        """The rows of the padded ``data`` that hold real rows, in order: ``[S, C]`` (FP8 codes as bytes)."""
        if self.bm == 1:
            return data
        if data.element_size() == 1:
            return data.view(torch.uint8)[self.dest].view(data.dtype)
        return data[self.dest]

    def dequantize_rows(self, codes: torch.Tensor, scale_inv: torch.Tensor, block: Any) -> torch.Tensor:
        """fp32 values of the real rows from their codes ``[S, C]`` and the padded buffer's tile scales."""
        if self.bm != 1:
            raw = codes.view(torch.uint8)
            raw = raw.new_zeros((self.size, raw.shape[1])).index_copy_(0, self.dest, raw)
            codes = raw.view(codes.dtype)
        return self.real(Operand(codes, scale_inv, block).dequantize(torch.float32))


def _stacked(ops: list[Operand]) -> torch.Tensor:
    """The experts' weights dequantized to fp32, ``[E, N, K]`` row-major."""
    return torch.stack([op.dequantize(torch.float32) for op in ops])


class _Fp8GroupedOffsetsFunction(torch.autograd.Function):
    """``fp8_grouped_linear``'s numerics with the counts on the device (module doc)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        counts: torch.Tensor,
        recipe: Fp8Recipe,
        kernels: Kernels,
        w_ops: list[Operand],
    ) -> torch.Tensor:
        ends = counts.cumsum(0).to(torch.int32)  # [E] each expert's last row + 1, on the device
        tiles = TokenTiles(counts, recipe.x_wgrad.block[0], x.shape[0])
        xq = kernels.quantize(x, recipe.x)  # [S,K] every expert's rows in one call (1 x k tiles)
        x_w = kernels.quantize(tiles.pad(x), recipe.x_wgrad)  # [P,K], no token tile mixes experts
        y = grouped_mm_nt(xq.dequantize(torch.float32), _stacked(w_ops), ends)
        # per expert [S_e,K] @ [K,N] -> [S_e,N], fp32 accumulate
        reuse = recipe.reuses_weight
        ctx.w_kept = w_ops if reuse and all(w.keep_for_backward for w in w_ops) else None
        w_saved = [t for w in w_ops for t in (w.data, w.scale_inv)] if reuse and ctx.w_kept is None else []
        ctx.save_for_backward(weight, counts, tiles.real(x_w.data), x_w.scale_inv, *w_saved)
        ctx.recipe, ctx.kernels, ctx.x_dtype = recipe, kernels, x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        recipe: Fp8Recipe = ctx.recipe
        kernels: Kernels = ctx.kernels
        weight, counts, x_codes, x_scale_inv, *w_saved = ctx.saved_tensors
        ends = counts.cumsum(0).to(torch.int32)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dyq = kernels.quantize(dy, recipe.dy)  # [S,N] in one call (1 x k tiles)
            w_dgrad = _stacked(_dgrad_weights(ctx, weight, w_saved))  # [E, N, K]
            dx = grouped_mm_nn(dyq.dequantize(torch.float32), w_dgrad, ends).to(ctx.x_dtype)
            # per expert [S_e,N] @ [N,K] -> [S_e,K], fp32 accumulate
        if ctx.needs_input_grad[1]:
            tiles = TokenTiles(counts, recipe.dy_wgrad.block[0], dy.shape[0])
            dy_w = kernels.quantize(tiles.pad(dy), recipe.dy_wgrad)  # [P,N], token tiles per expert
            dy_rows = tiles.real(dy_w.dequantize(torch.float32))  # [S,N]
            x_rows = tiles.dequantize_rows(x_codes, x_scale_inv, recipe.x_wgrad.block)  # [S,K]
            dw = grouped_mm_tn(dy_rows, x_rows, ends).to(weight.dtype)
            # per expert [N,S_e] @ [S_e,K] -> [N,K], fp32 accumulate; zero for an expert without rows
        return dx, dw, None, None, None, None


#: ``fp8_grouped_linear_offsets(x [S, K], weight [E, N, K], counts [E] on the device, recipe, kernels,
#: w_ops) -> [S, N]``: ``fp8_grouped_linear`` with the counts left on the device, where ``runs_on_offsets``
fp8_grouped_linear_offsets = _Fp8GroupedOffsetsFunction.apply
