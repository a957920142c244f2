"""FP8 weight all-gather under FSDP2: weights travel between ranks as their FP8 codes.

FSDP2 keeps each rank's rows of every weight (the fp32 master shard, dim 0 cut evenly: rank ``r`` of
``W`` holds rows ``[r * P, r * P + P)`` with ``P = ceil(N / W)``) and all-gathers the whole weight
before a layer runs. For an ``Fp8Linear`` whose GEMMs only ever read the weight quantized with
128x128 blocks (``recipe.gathers_fp8_weight``: fprop and dgrad use the same blocks), the high-precision
weight is never needed on the other ranks, so the all-gather can carry the FP8 codes (1 byte per
element instead of 2 for bf16, 4 for fp32). The codes must be exactly those the GEMMs see in one
process, ``quantize(W_full, 128x128)``; the only thing a rank cannot compute alone is the block
amax, because a 128-row block straddles ranks whenever ``P`` is not a multiple of 128::

    partial  = amax of |w| over this rank's rows of every block      [ceil(N/128), ceil(K/128)] fp32
    amax     = all_reduce(partial, MAX) over the shard group          (a few KB per weight; one
                                                                       all-reduce per FSDP unit)
    scale    = amax_to_scale(amax)                                    the rule of infir2.fp8.quantize
    codes_r  = saturating_cast(w_r * scale[block of each row])        this rank's rows, FP8
    codes    = all_gather(codes_r as uint8)                           [N, K]; scale_inv = 1 / scale

The maximum is exact in any order, so ``amax`` is bit-identical to the one-process amax, and so are
the scales and codes (a NaN in a block is sent as +inf: both give scale 1, and MAX keeps +inf in
any order, which it does not promise for NaN). Codes go as ``uint8`` because some backends (gloo)
cannot send FP8 dtypes.

The block amaxes of all FP8 weights of one FSDP unit (a decoder layer: seven projections) travel in
one all-reduce: the unit's first FP8 weight to be all-gathered computes the partial amaxes of the
unit's FP8 weights, all-reduces them as one flat tensor and leaves each later weight its slice,
which that weight's all-gather (next in the same loop of FSDP2) takes. Without the link to FSDP2's
parameter groups (``infir2.nn.convert.link_fsdp_params``) each weight all-reduces its own.

Streams: FSDP2 runs ``fsdp_pre_all_gather`` on its all-gather copy-in stream, so ``scale_inv`` is
allocated from that stream's memory pool, but forward and backward (the saved dgrad weight) read it
on the compute stream. ``fsdp_post_all_gather`` (on the compute stream) records it there
(``record_stream``), so the allocator does not hand its block to the next prefetch while compute
may still read it.

Mechanism: FSDP2's all-gather extension (the one torchao's float8 uses). The sharded parameter's
local tensor is an :class:`Fp8ShardedWeight`, a thin wrapper that behaves as the fp32 shard for
every op (optimizer, clipping, state dicts) and adds ``fsdp_pre_all_gather`` (the amax all-reduce
and quantization above; returns the uint8 codes to gather) and ``fsdp_post_all_gather`` (turns the
gathered codes into an :class:`Fp8GatheredWeight`). That unsharded parameter holds the
:class:`~infir2.kernels.Operand` that ``Fp8Linear.quantized_weight`` returns as is; fprop and dgrad
both use it, so no high-precision copy of an FP8 weight is ever gathered. The gradient of the
gathered weight is an ordinary tensor of the parameter dtype, reduce-scattered as usual. A module
whose FP8 is off (``disable_fp8``: the high-precision evaluation) gathers its weight in the parameter
dtype as without ``param_gather``; FSDP2 sizes its all-gather buffers once, so on such a switch
the weight drops them (``infir2.nn.convert.link_fsdp_params`` gives it access; a few lines on
FSDP2 internals). The model walks that install the wrapper (``enable_fp8_param_gather``) and link it
live with the other model switches in ``infir2.nn.convert``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map_only

from ..fp8.formats import get_format
from ..fp8.quantize import Block, expand_blocks, quantize_with_amax, resolve_block
from ..fp8.recipe import Cast, Fp8Recipe
from ..kernels import Operand, triton_backend

__all__ = [
    "AMAX_ALL_REDUCE_HOOKS",
    "Fp8GatheredWeight",
    "Fp8ShardedWeight",
    "drop_gather_buffers",
    "partial_block_amax",
]

aten = torch.ops.aten

#: Instrumentation: functions called with each block-amax tensor this process all-reduces for an FP8
#: weight all-gather, one call per all-reduce (``infir2.tools.wire_bytes.AmaxBytes`` counts bytes and
#: collectives). Empty in training.
AMAX_ALL_REDUCE_HOOKS: list[Callable[[torch.Tensor], None]] = []


def _row_block_index(row_offset: int, rows: int, bm: int, device: torch.device) -> torch.Tensor:
    """Block row of each of ``rows`` rows starting at global row ``row_offset``."""
    return torch.div(torch.arange(row_offset, row_offset + rows, device=device), bm, rounding_mode="floor")


def partial_block_amax(shard: torch.Tensor, row_offset: int, n_rows: int, block: Block) -> torch.Tensor:
    """Amax of |shard| per block of the full ``[n_rows, K]`` weight, over this shard's rows only.

    ``shard [rows, K]`` holds global rows ``row_offset ..``; blocks it does not touch are 0 (the MAX
    identity for amaxes). NaN is returned as +inf (see the module docstring).
    """
    k = shard.shape[1]
    bm, bk = resolve_block(block, (n_rows, k))
    amax = torch.zeros(math.ceil(n_rows / bm), math.ceil(k / bk), dtype=torch.float32, device=shard.device)
    if shard.shape[0] == 0:
        return amax
    row_amax = expand_blocks(shard.float(), (1, bk)).abs().amax(dim=(1, 3))  # [rows, Kb]
    row_amax = torch.where(row_amax.isnan(), math.inf, row_amax)
    index = _row_block_index(row_offset, shard.shape[0], bm, shard.device)
    return amax.scatter_reduce_(0, index[:, None].expand_as(row_amax), row_amax, "amax")


class Fp8GatheredWeight(torch.Tensor):
    """An all-gathered FP8 weight: outer shape ``[N, K]`` and the parameter dtype, data in ``operand``."""

    operand: Operand

    @staticmethod
    def __new__(cls, operand: Operand, dtype: torch.dtype, requires_grad: bool = False) -> Fp8GatheredWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, operand.shape, dtype=dtype, device=operand.data.device, requires_grad=requires_grad
        )

    def __init__(self, operand: Operand, dtype: torch.dtype, requires_grad: bool = False) -> None:
        self.operand = operand

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, block={self.operand.block})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default) or (
            func is aten.as_strided.default and tuple(args[1]) == tuple(args[0].shape)
        ):  # FSDP wraps the gathered tensor in a Parameter (detach) after an as_strided to its own shape
            return cls(args[0].operand, args[0].dtype)

        def dequantize(t: Fp8GatheredWeight) -> torch.Tensor:
            return t.operand.dequantize(t.dtype)

        return func(*tree_map_only(cls, dequantize, args), **tree_map_only(cls, dequantize, kwargs))


#: ops whose result is still "the master shard" (FSDP2 builds its shards with them; torchao keeps the same set)
_KEEP_WRAPPER = {
    aten.detach.default,
    aten.alias.default,
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten._pin_memory.default,
    aten.split.Tensor,
    aten.clone.default,
}


class Fp8ShardedWeight(torch.Tensor):
    """The high-precision weight (or its FSDP shard) of an ``Fp8Linear``, all-gathered as FP8 codes.

    Every op sees the wrapped tensor; only FSDP2's all-gather hooks differ (module docstring).
    """

    _tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor) -> Fp8ShardedWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            device=tensor.device,
            layout=tensor.layout,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Fp8ShardedWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        out = func(
            *tree_map_only(cls, lambda t: t._tensor, args),
            **tree_map_only(cls, lambda t: t._tensor, kwargs or {}),
        )
        if func not in _KEEP_WRAPPER:
            return out
        return tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], meta: None, size: Any, stride: Any
    ) -> Fp8ShardedWeight:
        return Fp8ShardedWeight(inner["_tensor"])

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """What this rank sends: ``_fp8_gather_inputs`` (FP8 codes), padded to FSDP2's rows per rank.

        With FP8 off on the module (``disable_fp8``: a high-precision evaluation) the shard is sent in
        the parameter dtype instead, as without ``param_gather``.
        """
        if mesh.ndim != 1:
            raise ValueError(f"FP8 param all-gather needs a 1-D FSDP mesh (got {mesh.ndim}-D)")
        fp8 = bool(getattr(module, "fp8_enabled", False))
        self._switch_format(module, fp8)
        shard = self._tensor
        padded = math.ceil(outer_size[0] / mesh.size())  # FSDP2's rows per rank (torch.chunk), the last fewer
        pad = (0, 0) * (shard.dim() - 1) + (0, padded - shard.shape[0])  # dim 0 to ``padded`` rows
        if not fp8:
            param_dtype = getattr(mp_policy, "param_dtype", None) or shard.dtype
            return (F.pad(shard.to(param_dtype), pad),), None
        return self._fp8_gather_inputs(module, mesh, outer_size[0], pad)

    def _switch_format(self, module: nn.Module, fp8: bool) -> None:
        _switch_format(module, fp8)

    def _fp8_gather_inputs(
        self, module: nn.Module, mesh: Any, n_rows: int, pad: tuple[int, ...]
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Quantize this rank's rows with the block scales of the full weight; send the codes as uint8."""
        recipe: Fp8Recipe = module.recipe  # type: ignore[assignment]
        shard = self._tensor
        offset = mesh.get_local_rank() * math.ceil(n_rows / mesh.size())
        amax = _reduced_block_amax(module, shard, n_rows, mesh)
        codes, scale_inv = _quantize_shard(shard, amax, recipe.w, offset, n_rows)
        return (F.pad(codes.view(torch.uint8), pad),), (scale_inv, recipe.w.block, recipe.w.fmt, n_rows)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The gathered FP8 operand (``_gathered_operand``) as a gathered weight; FSDP's buffer holds the codes."""
        if metadata is None:  # high precision (FP8 off): FSDP takes the gathered tensor as it is
            return None if out is not None else (all_gather_outputs[0], ())
        operand = self._gathered_operand(all_gather_outputs, metadata)
        if out is not None:  # later steps: same buffers, new scales
            if not isinstance(out, Fp8GatheredWeight):
                raise TypeError(
                    f"expected the Fp8GatheredWeight of an earlier all-gather, got {type(out).__name__}"
                )
            out.operand = operand
            return None
        return Fp8GatheredWeight(operand, param_dtype), ()  # the codes live in FSDP's own buffer

    def _gathered_operand(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any) -> Operand:
        """The gathered codes ``[W * P, K]`` (uint8) as the ``[N, K]`` FP8 operand."""
        (codes_u8,) = all_gather_outputs
        scale_inv, block, fmt, n_rows = metadata
        if scale_inv.is_cuda:  # made on FSDP's copy-in stream, read on this (compute) one: module doc
            scale_inv.record_stream(torch.cuda.current_stream(scale_inv.device))
        return Operand(codes_u8.view(get_format(fmt).dtype)[:n_rows], scale_inv, block)


def _quantize_shard(
    shard: torch.Tensor, amax: torch.Tensor, cast: Cast, row_offset: int, n_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows with the block scales of the whole weight: one Triton pass on a GPU that runs it,
    the multi-pass reference elsewhere (the same codes either way)."""
    if triton_backend.takes_shard(shard, cast):
        return triton_backend.quantize_with_amax(shard, amax, cast, row_offset)
    return quantize_with_amax(
        shard, amax, cast.block, cast.fmt, cast.scale_encoding, row_offset=row_offset, n_rows=n_rows
    )


def _reduced_block_amax(module: nn.Module, shard: torch.Tensor, n_rows: int, mesh: Any) -> torch.Tensor:
    """The block amax of the full weight of ``module``, all-reduced over the shard group.

    Left by an earlier weight of the same FSDP unit when there is one (module docstring); otherwise
    this weight's partial amaxes and those of the unit's later FP8 weights go in one all-reduce.
    """
    stash = module.__dict__.pop("_fp8_amax_stash", None)
    if stash is not None:
        return stash
    world, rank = mesh.size(), mesh.get_local_rank()
    jobs: list[tuple[nn.Module, torch.Tensor, int]] = [(module, shard, n_rows)]
    peers, index = getattr(module, "_fp8_amax_peers", ((), 0))
    for ref in peers[index + 1 :]:  # the unit's FP8 weights that FSDP2 all-gathers after this one
        fsdp_param = ref()
        if fsdp_param is None:
            continue
        local, peer = fsdp_param._sharded_local_tensor, fsdp_param._module_info.module
        if isinstance(local, Fp8ShardedWeight) and getattr(peer, "fp8_enabled", False):
            jobs.append((peer, local._tensor, int(fsdp_param._orig_size[0])))
    blocks = [cast(Fp8Recipe, m.recipe).w.block for m, _, _ in jobs]
    partials = [
        partial_block_amax(t, rank * math.ceil(rows / world), rows, block)
        for (_, t, rows), block in zip(jobs, blocks, strict=True)
    ]
    flat = torch.cat([p.reshape(-1) for p in partials]) if len(partials) > 1 else partials[0].reshape(-1)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=mesh.get_group())
    for hook in AMAX_ALL_REDUCE_HOOKS:  # instrumentation only (empty unless a benchmark counts)
        hook(flat)
    sizes = [p.numel() for p in partials]
    pieces = [piece.view_as(p) for piece, p in zip(flat.split(sizes), partials, strict=True)]
    for (peer, _, _), piece in zip(jobs[1:], pieces[1:], strict=True):
        peer.__dict__["_fp8_amax_stash"] = piece
    return pieces[0]


def _switch_format(module: nn.Module, fp8: bool) -> None:
    """FSDP2 sizes a parameter's all-gather buffers once: drop them when the gathered format changes."""
    previous = getattr(module, "_fp8_gathered", None)
    setattr(module, "_fp8_gathered", fp8)  # noqa: B010 (an attribute nn.Module does not declare)
    if previous is None or previous == fp8:
        return
    ref = getattr(module, "_fp8_fsdp_param", None)
    drop_gather_buffers(ref() if ref is not None else None, "weight")


def drop_gather_buffers(fsdp_param: Any, what: str) -> None:
    """Make FSDP2 reallocate ``fsdp_param``'s all-gather buffers (``None``: not linked, an error naming ``what``)."""
    if fsdp_param is None:
        raise RuntimeError(
            f"switching an FP8 all-gather {what} between FP8 and high precision needs "
            "infir2.nn.convert.link_fsdp_params(module) after fully_shard (shard_model does it)"
        )
    fsdp_param.all_gather_outputs = []  # FSDP2 internals (torch 2.13): reallocated by the next all-gather
    fsdp_param._unsharded_inner_tensors = []
    if hasattr(fsdp_param, "_unsharded_param"):
        del fsdp_param._unsharded_param  # rebuilt by the next all-gather
