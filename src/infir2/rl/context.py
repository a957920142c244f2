"""Long responses: a micro-batch's prompt + response rows split over the context ranks (``parallel.context``).

Under ``parallel.context: C`` the world is data x context, as in ``infir2 train`` (docs/DISTRIBUTED.md): each
data replica is ``C`` ranks that share every sequence. RL's scoring (old, reference and policy
log-probabilities, the entropy) and its update run each micro-batch's rows split along the sequence, so
one rank holds the activations of ``L / C`` tokens of a response; the rollout is not split (each rank's
engine generates whole sequences: ``rl/collect.py``). For a micro-batch's ``Rows`` (prompts left-padded,
responses right-padded, as the engine generates), ``row_shard``:

1. writes the rows as a training micro-batch: ``labels`` the response tokens (``IGNORE_INDEX`` on the
   prompt and the padding), the positions one process scores them at (``data.left_pad_positions``), the mask;
2. hands it to ``data.context.shard_micro_batch``, the split CPT and SFT use: the row padded at its end to
   a multiple of ``C x 128`` tokens, the labels shifted on the whole row (the last token of a shard
   predicts the first of the next), this rank's contiguous ``L / C`` tokens; padding, left or right, is a
   document of its own that no real token attends to -- the keys one process masks out;
3. holds ``loss.shard_context`` around the forward and the backward (activation checkpointing recomputes
   the attention in backward, which gathers the other shards' keys again).

With routing replay the rows' routes are split the same way (``row_routes``: padded at the end, this
rank's contiguous tokens).

``shard_response_logprobs`` scores the shard's targets (``loss.score_tokens``, chunked as ever) and lays
them out as the response columns ``[B, R]``: every response token is scored by exactly one rank (the one
that holds the token before it) and the others add zeros, so ``context_sum`` (an all-reduce over the
group) gives every context rank the whole rows' log-probabilities, those of one process, and the same
loss. Its backward is the identity: each rank's graph reaches only the tokens it scored, so the context
ranks' gradients are partial sums of that one loss's gradient, which FSDP2's reduce-scatter adds (with
the loss scaled by ``world / tokens`` for its average) as it adds the data ranks'. The rows' statistics
are counted on context rank 0 only: the other ranks of its group hold the same rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..data.base import IGNORE_INDEX, MicroBatch, left_pad_positions
from ..data.context import shard_micro_batch
from ..harness.distributed import ContextLayout
from ..loss import score_tokens, shard_context
from .batch import Rows

__all__ = ["RowShard", "context_sum", "row_routes", "row_shard", "shard_response_logprobs"]


@dataclass(frozen=True)
class RowShard:
    """This rank's shard of a micro-batch's rows (``data.context.shard_micro_batch``'s keys), the column of
    the first response token (the prompt width) and the context group."""

    batch: MicroBatch
    prompt_width: int
    group: dist.ProcessGroup | None


def as_micro_batch(rows: Rows) -> MicroBatch:
    """``rows`` as a training micro-batch: labels on the response tokens, one process's positions."""
    mask = rows.attention_mask
    labels = rows.ids.masked_fill(~mask.bool(), IGNORE_INDEX)
    labels[:, : rows.prompt_width] = IGNORE_INDEX  # a prompt token is no target
    positions = left_pad_positions(mask)  # as rl.update.response_logprobs scores one process
    return {"input_ids": rows.ids, "labels": labels, "attention_mask": mask, "position_ids": positions}


@contextmanager
def row_shard(rows: Rows, layout: ContextLayout) -> Iterator[RowShard | None]:
    """This rank's ``RowShard`` of ``rows``, with attention told where it lies, for a forward and its
    backward; None at context 1 (the rows scored whole)."""
    if layout.context == 1:
        yield None
        return
    shard = shard_micro_batch(as_micro_batch(rows), layout.context_rank, layout.context)
    with shard_context(shard):
        yield RowShard(shard, rows.prompt_width, layout.group)


def row_routes(rows: Rows, part: RowShard | None) -> torch.Tensor | None:
    """The routes to replay (``Rows.routes``, routing replay) for this rank's tokens of ``rows``: whole at
    context 1, else padded at the end (``-1``: route afresh) and cut as the shard's tokens are."""
    if rows.routes is None or part is None:
        return rows.routes
    mb = part.batch
    width, start, size = mb["documents"].shape[1], int(mb["context_start"]), mb["input_ids"].shape[1]
    routes = rows.routes
    pad = routes.new_full((routes.shape[0], width - routes.shape[1], *routes.shape[2:]), -1)
    return torch.cat([routes, pad], dim=1)[:, start : start + size]


class _ContextSum(torch.autograd.Function):
    """All-reduce (sum) over the context group; backward: the identity (every rank computes the same loss
    of the sum, and its own summand reaches only the tokens it scored)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def context_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` summed over the context group (module doc: the backward is the identity)."""
    return _ContextSum.apply(x, group)


def shard_response_logprobs(
    model: nn.Module, part: RowShard, width: int, temperature: float, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, width]`` log-probabilities (and entropies) of the response tokens of the rows ``part`` is a
    shard of, summed over the context group (each token scored by one rank; module doc)."""
    device = next(model.parameters()).device
    mb = part.batch
    ids = mb["input_ids"].to(device)
    logp, ent = score_tokens(
        model,
        ids,
        mb["shift_labels"].to(device),
        None,  # every position of the shard: its targets are shifted on the whole row
        position_ids=mb["position_ids"].to(device),
        temperature=temperature,
        entropy=entropy,
        ignore_index=IGNORE_INDEX,
    )
    start = int(mb["context_start"])
    # shard position s holds row token start + s, which predicts response column start + s - (P - 1)
    columns = torch.arange(start, start + ids.shape[1], device=device) - (part.prompt_width - 1)
    own = (columns >= 0) & (columns < width)

    def spread(x: torch.Tensor) -> torch.Tensor:  # [B, l] -> [B, width], zeros where another rank scores
        out = x.new_zeros((x.shape[0], width)).index_copy(1, columns[own], x[:, own])
        return context_sum(out, part.group)

    return spread(logp), None if ent is None else spread(ent.detach())
