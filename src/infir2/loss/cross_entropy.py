"""The next-token loss, defined once: for a training step, for validation, for ``infir2 eval --perplexity``.

It is the token scorer's (``loss.scorer.score_tokens``: chunked under a memory budget) log-probabilities
of the next tokens, negated and summed: the same function RL scores its responses with.

``token_ce_sum`` is the summed next-token cross-entropy of one micro-batch (labels aligned with the
inputs, Hugging Face convention, shifted here; ``IGNORE_INDEX`` labels carry no loss; logits in fp32).
The training step divides it by the global count of loss tokens; ``heldout_loss`` sums it over
held-out steps and divides by their loss tokens, with FP8 off unless asked (``nn.fp8_enabled``), as the
exported model runs. Training's validation (``train.loop.evaluate``) and ``eval.perplexity.evaluate_loss``
both call ``heldout_loss`` on ``data.tokens.val_batches`` (CPT) -- one definition, so the validation loss
a run logs is the number ``infir2 eval --perplexity`` prints for the same windows.

The ``loss`` package sits beside ``model.py`` (it imports data, model and nn) so that train, eval and rl,
which may not import each other, share it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from tqdm.auto import tqdm

from ..data.base import IGNORE_INDEX, MicroBatch, count_loss_tokens
from ..model import autocast
from ..nn import cache_fp8_weights, fp8_enabled
from ..nn.context_parallel import SequenceShard, sequence_shard
from .scorer import score_tokens

__all__ = ["heldout_loss", "lm_loss_sum", "shard_context", "token_ce_sum"]


def token_ce_sum(
    model: nn.Module,
    mb: MicroBatch,
    precision: str,
    device: torch.device,
    loss_chunk_tokens: int | str = "auto",
) -> torch.Tensor:
    """Summed next-token cross-entropy of one micro-batch (labels shifted here, HF convention).

    Above ``loss_chunk_tokens``' threshold (``scorer.chunk_tokens_for``) the LM head and the loss run
    chunk by chunk: no full fp32 ``[tokens, vocab]`` logits in forward or backward.
    """
    input_ids = mb["input_ids"].to(device, non_blocking=True)
    chunk = loss_chunk_tokens
    if "documents" in mb:  # a context-parallel shard (data.context.shard_micro_batch)
        targets, shard_positions = mb["shift_labels"].to(device), mb["position_ids"].to(device)
        with autocast(precision, device), shard_context(mb):
            return lm_loss_sum(model, input_ids, targets, None, chunk, IGNORE_INDEX, shard_positions, True)
    labels = mb["labels"].to(device, non_blocking=True)
    mask: torch.Tensor | None = mb.get("attention_mask")
    positions = mb.get("position_ids")
    if positions is not None:  # packed documents: transformers masks by the restarts of position_ids
        mask = None  # (only without a 2-D mask; the padding at a row's end is a document of its own)
    with autocast(precision, device):
        return lm_loss_sum(
            model,
            input_ids,
            labels,
            None if mask is None else mask.to(device),
            chunk,
            IGNORE_INDEX,
            None if positions is None else positions.to(device),
        )


def lm_loss_sum(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    chunk_tokens: int | str | None = "auto",
    ignore_index: int = IGNORE_INDEX,
    position_ids: torch.Tensor | None = None,
    shifted: bool = False,
) -> torch.Tensor:
    """Summed next-token CE of a HF causal LM (``-sum`` of ``score_tokens``' log-probabilities; labels
    equal to ``ignore_index`` carry none). Labels are shifted here, unless ``shifted`` (a context shard's:
    ``labels[:, t]`` is the target of token ``t``). ``chunk_tokens``: ``scorer.chunk_tokens_for``'s setting."""
    targets = labels if shifted else labels[:, 1:]
    logp, _ = score_tokens(
        model,
        input_ids,
        targets,
        None if shifted else input_ids.shape[1] - 1,
        attention_mask=attention_mask,
        position_ids=position_ids,
        chunk_tokens=chunk_tokens,
        ignore_index=ignore_index,
    )
    return -logp.sum()


def shard_context(mb: MicroBatch) -> AbstractContextManager[None]:
    """Where a context shard's attention finds the rest of its sequence (``nn.sequence_shard``), for its
    forward and its backward (activation checkpointing runs attention again there); other micro-batches:
    nothing."""
    if "documents" not in mb:
        return nullcontext()
    return sequence_shard(SequenceShard(mb["documents"], int(mb["context_start"]), mb["input_ids"].shape[1]))


@torch.no_grad()
def heldout_loss(
    model: nn.Module,
    steps: Iterable[list[MicroBatch]],
    precision: str = "fp32",
    device: torch.device | None = None,
    fp8: bool = False,
    max_steps: int | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    progress: bool = False,
    loss_chunk_tokens: int | str = "auto",
) -> tuple[float, int]:
    """``(loss per token, loss tokens)`` over the first ``max_steps`` of ``steps`` (all when None).

    The model runs in eval mode (restored after), FP8 off unless ``fp8``; ``reduce`` sums the fp64
    ``[ce sum, loss tokens]`` over processes (training passes its all-reduce). No tokens: ``nan``.
    """
    device = device if device is not None else next(model.parameters()).device
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [ce sum, loss tokens]
    was_training = model.training
    model.eval()
    try:
        with fp8_enabled(model, fp8), cache_fp8_weights(model) if fp8 else nullcontext():
            taken = steps if max_steps is None else (s for _, s in zip(range(max_steps), steps, strict=False))
            for micro_batches in tqdm(taken, desc="held-out loss", unit="step", disable=not progress):
                for mb in micro_batches:
                    totals[0] += token_ce_sum(model, mb, precision, device, loss_chunk_tokens).double()
                totals[1] += count_loss_tokens(micro_batches)
    finally:
        model.train(was_training)
    if reduce is not None:
        totals = reduce(totals)
    ce, n = totals.tolist()
    return (ce / n if n else math.nan), int(n)
