"""Instrumentation for the FSDP2 wire-bytes benchmark: what the all-gathers of a step move.

``WireBytes.install(model)`` counts the bytes every FSDP2 parameter all-gather delivers to this rank;
``AmaxBytes.install()`` the block amaxes the FP8 weight all-gather all-reduces first (through
``infir2.nn.fsdp.AMAX_ALL_REDUCE_HOOKS``). Benchmarks and tests only: training never installs them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..nn.fsdp import AMAX_ALL_REDUCE_HOOKS

__all__ = ["AmaxBytes", "WireBytes"]


class WireBytes:
    """Bytes that FSDP2's parameter all-gathers deliver to this rank (every shard, its own included).

    Installed with :meth:`install` through FSDP2's ``set_custom_all_gather`` on every FSDP module of a
    model; each all-gather still runs ``dist.all_gather_single``. ``bytes`` is what the
    benchmark and the docs call "all-gather bytes per rank".
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0

    @classmethod
    def install(cls, model: nn.Module) -> WireBytes:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

        counter = cls()

        class _Counting(AllGather):
            def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(
                self,
                output_tensor: torch.Tensor,
                input_tensor: torch.Tensor,
                group: dist.ProcessGroup,
                async_op: bool = False,
            ) -> Any:
                counter.bytes += output_tensor.numel() * output_tensor.element_size()
                counter.calls += 1
                return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(_Counting())
        return counter


class AmaxBytes:
    """Bytes of block amaxes this process all-reduces for FP8 weight all-gathers, and the number of
    those all-reduces (latency-bound: one per FSDP unit and all-gather), while installed."""

    def __init__(self) -> None:
        self.bytes = 0
        self.collectives = 0

    def __call__(self, amax: torch.Tensor) -> None:
        self.bytes += amax.numel() * amax.element_size()
        self.collectives += 1

    @classmethod
    def install(cls) -> AmaxBytes:
        counter = cls()
        AMAX_ALL_REDUCE_HOOKS.append(counter)
        return counter

    def remove(self) -> None:
        AMAX_ALL_REDUCE_HOOKS.remove(self)
