"""Context parallelism: one sequence split along its tokens over ``C`` processes, attention made whole.

The method is the all-gather of keys and values (the scheme Llama 3 trained long context with). Each
rank of a context group holds one contiguous shard of every sequence, ``L / C`` tokens starting at a
multiple of 128 (``fp8.formats.BLOCK``), and runs the whole model on it: embeddings, norms, every linear
and the MLP see exactly the rows one process would give them, so every 1x128 activation tile is the tile
of the unsharded run and its FP8 codes are the same. Only attention looks across tokens; there::

    K, V  = all_gather_seq(k_shard), all_gather_seq(v_shard)     # [B,Hkv,l,D] x C -> [B,Hkv,L,D]
    out   = softmax(q_shard K^T * scale + mask) V                  # [B,H,l,D], a chunk of rows at a time
    mask[i, j] = global(j) <= global(i)  and  doc(j) == doc(i)      (padding is a document of its own)

RoPE has already been applied with the tokens' own position ids before the gather, so the gathered keys
are the ones the unsharded run makes. The backward of the gather reduce-scatters (sums) the gradients of
``K`` and ``V`` over the group: each rank gets the sum, over every rank's queries, for its own shard's
keys -- the single-process gradient up to the order of that sum. Weight gradients are sums over tokens,
so FSDP2 sharding over the whole (data x context) world adds the context ranks' partial sums exactly as
it adds the data ranks'.

Why not torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``): it needs the
flash / efficient SDPA kernels (CUDA), has no CPU / gloo path to test against one process, and has no
document mask; Ulysses (all-to-all over heads) needs the heads divisible by ``C``. The all-gather
keeps ``L`` keys per rank (``2 * L * Hkv * D`` values per layer, small with GQA) and needs neither.

The attention itself (``_ShardAttention``) is written out, a chunk of query rows at a time, because
torch's SDPA with an arbitrary mask keeps that mask expanded over the heads for backward (``H * l * L``
bytes per layer: 7.5 GB per layer for a 7B model at 32k on 4 ranks). It keeps ``q, K, V``, the output
and one log-sum-exp per row, and recomputes the scores per chunk in backward (``CHUNK_BYTES`` bounds a
chunk's fp32 scores). It is plain torch, so it runs the same on CPU and GPU; a fused kernel (flash /
flex attention with a document mask) is where GPU speed would come from (docs/DISTRIBUTED.md).

``enable_context_parallel(model, group)`` makes every attention layer of a transformers model use
``context_attention`` (registered under ``ATTENTION`` in transformers' ``AttentionInterface``; the HF
model code is unchanged), and ``sequence_shard(shard)`` tells it, for one forward + backward, where this
rank's rows lie and which document each token of the whole sequence belongs to.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..fp8.accumulate import accumulation_dtype

__all__ = [
    "ATTENTION",
    "SequenceShard",
    "all_gather_sequence",
    "context_attention",
    "enable_context_parallel",
    "sequence_shard",
    "shard_attention",
]

#: the name ``context_attention`` is registered under in transformers' ``AttentionInterface``
ATTENTION = "infir2_context"


@dataclass(frozen=True)
class SequenceShard:
    """Where this rank's rows lie in the whole sequence, and what attention may see.

    ``documents``: ``[B, L]`` the document index of every token of the whole sequence (tokens attend
    only within their document, causally by global index); ``start``: the global index of this rank's
    first row; ``rows``: its row count ``l``.
    """

    documents: torch.Tensor
    start: int
    rows: int

    def allowed(self, first: int, rows: int, device: torch.device) -> torch.Tensor:
        """``[B, rows, L]`` bool for this shard's rows ``first .. first + rows``: causal by global index,
        within a document."""
        start = self.start + first
        q = torch.arange(start, start + rows, device=device)
        k = torch.arange(self.documents.shape[1], device=device)
        docs = self.documents.to(device)
        return (k[None, None, :] <= q[None, :, None]) & (
            docs[:, None, :] == docs[:, start : start + rows, None]
        )


_SHARD: ContextVar[SequenceShard | None] = ContextVar("infir2_sequence_shard", default=None)


@contextmanager
def sequence_shard(shard: SequenceShard) -> Iterator[None]:
    """``context_attention`` reads ``shard`` inside this block (one micro-batch's forward)."""
    token = _SHARD.set(shard)
    try:
        yield
    finally:
        _SHARD.reset(token)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (the sequence of ``[B, H, l, D]``); backward: reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)  # [B,H,l,D] x C -> [B,H,C*l,D]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        size = dist.get_world_size(ctx.group)
        parts = [p.contiguous() for p in grad.chunk(size, dim=2)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` ``[B, H, l, D]`` of every rank of ``group`` side by side along the sequence (``None``: ``x``)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group)


#: the fp32 scores of one query chunk (``[B, H, chunk, L]``) stay under this many bytes: 73 rows of 7B
#: (28 heads) at 32k keys; the chunk's temporaries (scores, probabilities, their gradient) are a few times it
CHUNK_BYTES = 256 << 20


def _chunk_rows(shape: torch.Size, length: int) -> int:
    batch, heads = shape[0], shape[1]
    return max(1, CHUNK_BYTES // (batch * heads * length * torch.finfo(torch.float32).bits // 8))


def _scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked fp32 scores of a query chunk: ``[B,G,R,c,D] @ [B,G,1,D,L] -> [B,G,R,c,L]`` (G KV heads, R
    query heads each)."""
    s = (q @ k.unsqueeze(2).transpose(-1, -2)).to(accumulation_dtype(q.dtype)) * scale
    return s.masked_fill(~allowed[:, None, None], float("-inf"))


class _ShardAttention(torch.autograd.Function):
    """Softmax attention of a shard's queries over the whole sequence, a chunk of query rows at a time:
    only ``q, K, V, out`` and the rows' log-sum-exp are kept for backward (no ``[l, L]`` mask or
    probabilities: the backward recomputes them per chunk). Every row's result depends only on that row
    and the keys, so a shard's rows are the rows the whole sequence gives."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard, scale: float
    ) -> torch.Tensor:
        batch, heads, rows, dim = q.shape
        groups = k.shape[1]
        qg = q.view(batch, groups, heads // groups, rows, dim)  # query heads grouped by their KV head
        out = torch.empty_like(qg)
        lse = torch.empty(qg.shape[:-1], dtype=accumulation_dtype(q.dtype), device=q.device)
        chunk = _chunk_rows(q.shape, k.shape[2])
        for c0 in range(0, rows, chunk):
            c = slice(c0, c0 + chunk)
            s = _scores(qg[:, :, :, c], k, shard.allowed(c0, qg[:, :, :, c].shape[3], q.device), scale)
            m = s.amax(dim=-1, keepdim=True)
            p = torch.exp(s - m)
            z = p.sum(dim=-1, keepdim=True)
            lse[:, :, :, c] = (m + torch.log(z))[..., 0]
            out[:, :, :, c] = (p / z).to(v.dtype) @ v.unsqueeze(2)  # [B,G,R,c,L] @ [B,G,1,L,D] -> [B,G,R,c,D]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shard, ctx.scale, ctx.chunk = shard, scale, chunk
        return out.view(batch, heads, rows, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        batch, heads, rows, dim = q.shape
        acc = accumulation_dtype(q.dtype)
        qg, dout = q.view(out.shape), grad.reshape(out.shape).to(acc)
        kf, vf = k.unsqueeze(2).to(acc), v.unsqueeze(2).to(acc)  # [B,G,1,L,D]
        delta = (dout * out.to(acc)).sum(dim=-1)  # [B,G,R,l]: rowsum(dO * O)
        dq = torch.empty_like(qg)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for c0 in range(0, rows, ctx.chunk):
            c = slice(c0, c0 + ctx.chunk)
            qc, dc = qg[:, :, :, c], dout[:, :, :, c]
            allowed = ctx.shard.allowed(c0, qc.shape[3], q.device)
            p = torch.exp(_scores(qc, k, allowed, ctx.scale) - lse[:, :, :, c, None])  # [B,G,R,c,L]
            dv += (p.transpose(-1, -2) @ dc).sum(dim=2)  # [B,G,R,L,c] @ [B,G,R,c,D] -> [B,G,L,D]
            ds = p * ((dc @ vf.transpose(-1, -2)) - delta[:, :, :, c, None])  # [B,G,R,c,L]
            dq[:, :, :, c] = ((ds @ kf) * ctx.scale).to(q.dtype)  # [B,G,R,c,L] @ [B,G,1,L,D] -> [B,G,R,c,D]
            dk += (ds.transpose(-1, -2) @ qc.to(acc)).sum(dim=2) * ctx.scale  # [B,G,L,D]
        return dq.view(batch, heads, rows, dim), dk.to(k.dtype), dv.to(v.dtype), None, None


def shard_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard, scale: float
) -> torch.Tensor:
    """``softmax(q K^T * scale + mask) V`` of a shard's queries ``[B, H, l, D]`` over the whole sequence's
    keys and values ``[B, Hkv, L, D]`` (``_ShardAttention``: chunked, only ``q, K, V``, out, lse kept)."""
    return _ShardAttention.apply(q, k, v, shard, scale)


def context_attention(
    module: nn.Module,
    query: torch.Tensor,  # [B, H, l, D]
    key: torch.Tensor,  # [B, Hkv, l, D]
    value: torch.Tensor,  # [B, Hkv, l, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: this shard's queries against the whole sequence's keys."""
    shard = _SHARD.get()
    if shard is None:
        raise RuntimeError(
            "context-parallel attention outside infir2.nn.sequence_shard: a context-parallel model runs "
            "on micro-batches split by infir2.data.shard_micro_batch"
        )
    if kwargs.get("sliding_window") is not None or (dropout and module.training):
        raise ValueError("context parallelism has no sliding-window attention and no attention dropout")
    group = getattr(module, "context_group", None)
    key = all_gather_sequence(key, group)  # [B, Hkv, L, D]
    value = all_gather_sequence(value, group)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = shard_attention(query, key, value, shard, scale)  # [B, H, l, D]
    return out.transpose(1, 2).contiguous(), None  # [B, l, H, D], as transformers' functions return


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    layers = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no self_attn modules: context parallelism cannot shard it"
        )
    return layers


def enable_context_parallel(model: nn.Module, group: dist.ProcessGroup | None) -> nn.Module:
    """Every attention layer of the transformers model ``model`` runs ``context_attention`` over ``group``
    (``None``: one process, the same attention without the gather). Refuses (``ValueError``) a model whose
    attention the method cannot shard: sliding windows, non-causal attention."""
    from transformers import AttentionInterface

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ValueError(f"{type(model).__name__}: not a transformers model; context parallelism needs one")
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
    if sliding or getattr(config, "use_sliding_window", False):
        raise ValueError(
            f"model: {config.model_type} uses sliding-window attention, which context parallelism cannot shard"
        )
    if not getattr(config, "is_causal", True):
        raise ValueError(
            f"model: {config.model_type} attention is not causal; context parallelism needs causal"
        )
    AttentionInterface.register(ATTENTION, context_attention)
    for layer in _attention_layers(model):
        layer.__dict__["context_group"] = (
            group  # a plain attribute (nn.Module's setattr wants tensors / modules)
        )
    config._attn_implementation = ATTENTION
    return model
