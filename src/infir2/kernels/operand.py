"""The operand a GEMM backend consumes: FP8 data, its ``scale_inv`` and the block shape."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fp8.quantize import Block, dequantize

__all__ = ["Operand"]


@dataclass(frozen=True)
class Operand:
    """A block-scaled FP8 matrix ``data [M, K]`` with ``scale_inv [ceil(M/bm), ceil(K/bk)]``.

    ``scale_inv`` is fp32, or ``float8_e8m0fnu`` (a power of two per block) for E8M0-scaled casts.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: Block

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def t(self) -> Operand:
        """The transpose ``[K, M]`` as a view: same bytes, transposed scales and block."""
        return Operand(self.data.t(), self.scale_inv.t(), (self.block[1], self.block[0]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.data, self.scale_inv, self.block, dtype)

    @property
    def keep_for_backward(self) -> bool:
        """What backward keeps of this operand: ``False`` (here) saves only ``data`` and ``scale_inv``
        (``save_for_backward``) and rebuilds the operand from them; ``True`` keeps this object whole.
        A backend whose operands carry more than the FP8 bytes (a decoded copy that backward reuses)
        overrides it."""
        return False

    def nbytes(self) -> int:
        return (
            self.data.numel() * self.data.element_size()
            + self.scale_inv.numel() * self.scale_inv.element_size()
        )
