"""The operand a GEMM backend consumes: FP8 data, its ``scale_inv`` and the block shape."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from ..fp8.nvfp4 import dequantize_nvfp4, pack_nibbles, unpack_nibbles
from ..fp8.quantize import Block, dequantize

__all__ = ["Nvfp4Operand", "Operand"]


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

    def saved(self) -> tuple[torch.Tensor, ...]:
        """The tensors backward saves of this operand (``save_for_backward``); :meth:`restore` inverts it."""
        return self.data, self.scale_inv

    @classmethod
    def restore(cls, tensors: tuple[torch.Tensor, ...], block: Block, cols: int) -> Operand:
        """The operand rebuilt from :meth:`saved`'s tensors (a plain one: what backward reads); ``cols``
        is the length of its rows (K), which a packed operand needs back."""
        data, scale_inv = tensors
        return Operand(data, scale_inv, block)

    def nbytes(self) -> int:
        return (
            self.data.numel() * self.data.element_size()
            + self.scale_inv.numel() * self.scale_inv.element_size()
        )


@dataclass(frozen=True)
class Nvfp4Operand(Operand):
    """An NVFP4 matrix (``infir2.fp8.nvfp4``): ``data`` one E2M1 code per byte (unpacked), ``scale_inv``
    the E4M3 block scales, ``tensor_scale_inv`` the fp32 scale of the whole tensor (a 0-d tensor).

    ``data`` may have more rows than the high-precision tensor: a random-Hadamard-transformed operand is
    zero-padded along tokens to a multiple of 16 (its GEMM partner is padded the same way).
    """

    tensor_scale_inv: torch.Tensor

    def t(self) -> Nvfp4Operand:
        return Nvfp4Operand(
            self.data.t(), self.scale_inv.t(), (self.block[1], self.block[0]), self.tensor_scale_inv
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_nvfp4(self.data, self.scale_inv, self.tensor_scale_inv, self.block, dtype)

    @cached_property
    def _packed(self) -> torch.Tensor:
        """``data`` two codes a byte (a zero code pads an odd row): made once, shared by every layer that
        saves this operand (q, k and v save one wgrad copy of their common input)."""
        return pack_nibbles(F.pad(self.data, (0, self.data.shape[1] % 2)))

    def saved(self) -> tuple[torch.Tensor, ...]:
        """Saved packed, 4 bits a code (the wgrad copy of X and the weight that backward keeps)."""
        return self._packed, self.scale_inv, self.tensor_scale_inv

    @classmethod
    def restore(cls, tensors: tuple[torch.Tensor, ...], block: Block, cols: int) -> Nvfp4Operand:
        packed, scale_inv, tensor_scale_inv = tensors
        return Nvfp4Operand(unpack_nibbles(packed)[:, :cols], scale_inv, block, tensor_scale_inv)

    def nbytes(self) -> int:
        """The bytes of packed storage: half a byte per code, the E4M3 scales and the fp32 tensor scale."""
        return (self.data.numel() + 1) // 2 + self.scale_inv.numel() + self.tensor_scale_inv.element_size()
