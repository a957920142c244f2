"""FP8 all-gather of expert weights under FSDP2: each expert's 128x128-block codes travel, not fp32 / bf16.

FSDP2 shards a 3-D expert weight ``[E, N, K]`` along dim 0, the expert index (``torch.chunk``: rank
``r`` holds experts ``[r * P, r * P + P)``, ``P = ceil(E / world)``, the last ranks fewer or none).
So every rank holds whole experts and, unlike a dense weight (``infir2.nn.fsdp``), needs no amax
all-reduce: it quantizes its own experts with the recipe's weight cast, exactly as one process
quantizes them (``Fp8Experts.quantized_weights``), and the all-gather carries::

    codes      uint8 [P, N, K]        each local expert's E4M3 codes (uint8: gloo sends no FP8 dtypes)
    scale_inv  fp32  [P, Nb, Kb]      its block scales (a few KB per expert)

After the gather the parameter is an ``Fp8GatheredWeight`` whose operand is :class:`ExpertOperands`
(one ``Operand`` per expert, views of the gathered buffer), which ``Fp8Experts`` uses for fprop and
dgrad as it is: bit-identical to one process. With FP8 off (``disable_fp8``) the shard goes in the
parameter dtype, as without ``param_gather``. The wrapper is installed by
``infir2.nn.convert.enable_fp8_param_gather`` and linked by ``link_fsdp_params`` (both cover the experts).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...fp8.formats import get_format
from ...fp8.quantize import quantize
from ...fp8.recipe import Fp8Recipe
from ...kernels import Operand
from ..fsdp import Fp8ShardedWeight, drop_gather_buffers

__all__ = ["ExpertOperands", "Fp8ShardedExperts", "link_fsdp_experts"]

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertOperands:
    """The all-gathered FP8 experts of one weight: ``data [E, N, K]`` codes and one ``Operand`` per expert."""

    data: torch.Tensor
    operands: tuple[Operand, ...]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def block(self) -> tuple[int, int]:
        return self.operands[0].block

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.stack([op.dequantize(dtype) for op in self.operands])


class Fp8ShardedExperts(Fp8ShardedWeight):
    """The fp32 shard (whole experts) of an ``Fp8Experts`` weight, all-gathered as FP8 codes (module doc)."""

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], meta: None, size: Any, stride: Any
    ) -> Fp8ShardedExperts:
        return Fp8ShardedExperts(inner["_tensor"])

    def _switch_format(self, module: nn.Module, fp8: bool) -> None:
        _switch_format(module, self, fp8)

    def _fp8_gather_inputs(
        self, module: nn.Module, mesh: Any, n_rows: int, pad: tuple[int, ...]
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Each local expert quantized as one process does (no amax all-reduce); codes as uint8, scales."""
        recipe: Fp8Recipe = module.recipe  # type: ignore[assignment]
        w, shard = recipe.w, self._tensor
        parts = [quantize(shard[e], w.block, w.fmt, w.scale_encoding) for e in range(shard.shape[0])]
        n, k = shard.shape[1:]
        nb, kb = _blocks(n, k, w.block)
        codes = (
            torch.stack([c for c, _ in parts])
            if parts
            else shard.new_empty((0, n, k), dtype=get_format(w.fmt).dtype)
        )
        scales = torch.stack([s for _, s in parts]) if parts else shard.new_empty((0, nb, kb))
        return (F.pad(codes.view(torch.uint8), pad), F.pad(scales, pad)), (w.block, w.fmt, n_rows)

    def _gathered_operand(  # type: ignore[override]
        self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any
    ) -> ExpertOperands:
        codes_u8, scales = all_gather_outputs
        block, fmt, experts = metadata
        data = codes_u8.view(get_format(fmt).dtype)[:experts]
        return ExpertOperands(data, tuple(Operand(data[e], scales[e], block) for e in range(experts)))


def _blocks(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    bm, bk = block
    return (1 if bm == -1 else -(-n // bm)), (1 if bk == -1 else -(-k // bk))


def link_fsdp_experts(fsdp_params: list[Any]) -> None:
    """After ``fully_shard``: let each FP8-gathered expert weight find its FSDP2 parameter (format switch)."""
    for fsdp_param in fsdp_params:
        if isinstance(fsdp_param._sharded_local_tensor, Fp8ShardedExperts):
            module = fsdp_param._module_info.module
            module.__dict__.setdefault("_fp8_fsdp_params", {})[fsdp_param._module_info.param_name] = (
                weakref.ref(fsdp_param)
            )


def _switch_format(module: nn.Module, shard: Fp8ShardedExperts, fp8: bool) -> None:
    """FSDP2 sizes a parameter's all-gather buffers once: drop them when the gathered format changes."""
    refs = module.__dict__.get("_fp8_fsdp_params", {})
    fsdp_param = next(
        (p for p in (r() for r in refs.values()) if p is not None and p._sharded_local_tensor is shard), None
    )
    key = fsdp_param._module_info.param_name if fsdp_param is not None else None
    formats = module.__dict__.setdefault("_fp8_gathered_formats", {})
    previous = formats.get(key)
    formats[key] = fp8
    if previous is None or previous == fp8:
        return
    drop_gather_buffers(fsdp_param, "expert weight")
