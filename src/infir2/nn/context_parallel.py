"""Context parallelism: one sequence split along its tokens over ``C`` processes, attention made whole.

The method is the all-gather of keys and values (the scheme Llama 3 trained long context with). Each
rank of a context group holds one contiguous shard of every sequence, ``L / C`` tokens starting at a
multiple of 128 (``fp8.formats.BLOCK``), and runs the whole model on it: embeddings, norms, every linear
and the MLP see exactly the rows one process would give them, so every 1x128 activation tile is the tile
of the unsharded run and its FP8 codes are the same. Only attention looks across tokens; there::

    K, V  = all_gather_seq(k_shard), all_gather_seq(v_shard)     # [B,Hkv,l,D] x C -> [B,Hkv,L,D]
    out   = sdpa(q_shard, K, V, mask[rows of this shard])          # [B,H,l,D]
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
keeps ``L`` keys per rank (``2 * L * Hkv * D`` values per layer, small with GQA) and needs neither. The
mask is materialized per shard (``[B, 1, l, L]`` booleans), which SDPA reads on CPU and on CUDA (its
memory-efficient kernel); docs/DISTRIBUTED.md gives the numbers.

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
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ATTENTION",
    "SequenceShard",
    "all_gather_sequence",
    "context_attention",
    "enable_context_parallel",
    "sequence_shard",
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

    def mask(self, device: torch.device) -> torch.Tensor:
        """``[B, 1, l, L]`` bool: causal by global index, within a document."""
        length = self.documents.shape[1]
        q = torch.arange(self.start, self.start + self.rows, device=device)
        k = torch.arange(length, device=device)
        docs = self.documents.to(device)
        allowed = (k[None, None, :] <= q[None, :, None]) & (
            docs[:, None, :] == docs[:, self.start : self.start + self.rows, None]
        )
        return allowed[:, None]


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
    if kwargs.get("sliding_window") is not None:
        raise ValueError("context parallelism has no sliding-window attention (use_sliding_window)")
    group = getattr(module, "context_group", None)
    key = all_gather_sequence(key, group)  # [B, Hkv, L, D]
    value = all_gather_sequence(value, group)
    repeats = query.shape[1] // key.shape[1]  # grouped-query attention: each KV head serves `repeats`
    key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    mask = shard.mask(query.device)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout if module.training else 0.0, scale=scaling
    )  # [B,H,l,D] @ [B,H,D,L] -> [B,H,l,L] -> softmax @ [B,H,L,D] -> [B,H,l,D]
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
        layer.context_group = group
    config._attn_implementation = ATTENTION
    return model
