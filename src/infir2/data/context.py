"""Micro-batches split along the sequence for context parallelism, and documents packed into rows.

``shard_micro_batch(mb, rank, degree)`` is rank ``rank``'s part of a micro-batch when ``degree``
processes share each sequence (``infir2.nn.context_parallel`` runs the model on it). In order:

1. the row is padded at its end to a multiple of ``degree * BLOCK`` tokens (pad ids, no loss, keys
   masked out), so every shard starts on a multiple of 128 tokens and the FP8 tiles of a shard are
   tiles of the whole sequence;
2. labels are shifted on the *whole* sequence: ``shift_labels[t] = labels[t + 1]``, so the label of a
   shard's last token is the first token of the next shard and no token is dropped at an edge; the
   last token of a document never predicts the next document's first (a packed row's ``position_ids``
   restart there, and that label is ``IGNORE_INDEX``);
3. the documents of the whole row (from ``position_ids``: a document starts where they restart;
   without them a row is one document) and its real tokens (``attention_mask``) travel whole, for the
   attention mask;
4. ``input_ids``, ``shift_labels`` and ``position_ids`` are cut to the rank's contiguous
   ``L / degree`` tokens.

The result holds ``shift_labels`` instead of ``labels`` (``data.base.count_loss_tokens`` counts it as
it is, no shift), so the loss tokens of all shards of a row add up to the row's. Degree 1 is the same
path with one shard: what the tests compare a context-parallel run against.

``pack_documents(docs, width)`` lays ``(input_ids, labels)`` documents end to end in rows of ``width``
tokens with ``position_ids`` restarting at each document (transformers' packed format).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from ..fp8.formats import BLOCK
from .base import IGNORE_INDEX, MicroBatch, StepSource

__all__ = [
    "ContextShards",
    "document_ids",
    "pack_documents",
    "shard_micro_batch",
    "shard_steps",
    "shift_labels",
]


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` document index of every token: a new document where ``position_ids`` do not go up by 1."""
    step = torch.diff(position_ids, dim=1, prepend=position_ids[:, :1] - 1)
    return (step != 1).cumsum(dim=1)


def shift_labels(labels: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """``out[:, t] = labels[:, t + 1]`` within a document, ``IGNORE_INDEX`` at its last token."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-1] = labels[:, 1:]
    out[:, :-1][documents[:, 1:] != documents[:, :-1]] = IGNORE_INDEX
    return out


def _pad_to(mb: MicroBatch, length: int, pad_id: int) -> MicroBatch:
    rows, width = mb["input_ids"].shape
    extra = length - width
    if extra == 0:
        return mb
    mask = mb.get("attention_mask", torch.ones(rows, width, dtype=torch.long))
    positions = mb.get("position_ids", torch.arange(width).expand(rows, width))
    # padding is its own document (position ids restart at 0), never a key of a real token, never a loss
    return {
        "input_ids": torch.cat([mb["input_ids"], torch.full((rows, extra), pad_id)], dim=1),
        "labels": torch.cat([mb["labels"], torch.full((rows, extra), IGNORE_INDEX)], dim=1),
        "attention_mask": torch.cat([mask, torch.zeros(rows, extra, dtype=mask.dtype)], dim=1),
        "position_ids": torch.cat([positions, torch.arange(extra).expand(rows, extra)], dim=1),
    }


def shard_micro_batch(mb: MicroBatch, rank: int, degree: int, pad_id: int = 0) -> MicroBatch:
    """Rank ``rank``'s contiguous shard of ``mb`` over ``degree`` context ranks (module docstring)."""
    if not 0 <= rank < degree:
        raise ValueError(f"context rank {rank} must be in [0, {degree})")
    rows, width = mb["input_ids"].shape
    unit = degree * BLOCK
    mb = {**mb, "position_ids": mb.get("position_ids", torch.arange(width).expand(rows, width))}
    mb = _pad_to(mb, -(-width // unit) * unit, pad_id)
    documents = document_ids(mb["position_ids"])
    valid = mb.get("attention_mask")
    if valid is not None:  # padding: its own document (-1), never a key of a real token, never a target
        documents = torch.where(valid.bool(), documents, -1)
    targets = shift_labels(mb["labels"], documents)
    if valid is not None:
        targets = torch.where(valid.bool(), targets, IGNORE_INDEX)
    size = documents.shape[1] // degree
    cut = slice(rank * size, (rank + 1) * size)
    out = {
        "input_ids": mb["input_ids"][:, cut],
        "shift_labels": targets[:, cut],
        "position_ids": mb["position_ids"][:, cut],
        "documents": documents,
        "context_start": torch.tensor(rank * size),
        "attention_mask": (documents[:, cut] >= 0).long(),  # real tokens (counted; attention uses documents)
    }
    return out


def pack_documents(
    docs: Sequence[tuple[Sequence[int], Sequence[int]]], width: int, pad_id: int = 0
) -> list[MicroBatch]:
    """Documents ``(input_ids, labels)`` end to end in rows of ``width`` tokens, one row per micro-batch,
    ``position_ids`` restarting at each document, the rest of a row padding (``attention_mask`` 0); the
    label of a document's first token is ``IGNORE_INDEX`` (it is no token's target after the shift).
    A document longer than ``width`` is a ``ValueError``; the order of ``docs`` is kept."""
    batches: list[MicroBatch] = []
    row: list[tuple[Sequence[int], Sequence[int]]] = []
    used = 0
    for i, (ids, labels) in enumerate(docs):
        if len(ids) > width or len(ids) != len(labels):
            raise ValueError(
                f"document {i}: {len(ids)} tokens (labels {len(labels)}) do not fit a row of {width}"
            )
        if used + len(ids) > width:
            batches.append(_packed_row(row, width, pad_id))
            row, used = [], 0
        row.append((ids, labels))
        used += len(ids)
    if row:
        batches.append(_packed_row(row, width, pad_id))
    return batches


def _packed_row(row: list[tuple[Sequence[int], Sequence[int]]], width: int, pad_id: int) -> MicroBatch:
    ids = torch.full((1, width), pad_id, dtype=torch.long)
    labels = torch.full((1, width), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((1, width), dtype=torch.long)
    mask = torch.zeros((1, width), dtype=torch.long)
    at = 0
    for doc_ids, doc_labels in row:
        n = len(doc_ids)
        ids[0, at : at + n] = torch.tensor(list(doc_ids))
        labels[0, at : at + n] = torch.tensor(list(doc_labels))
        labels[0, at] = IGNORE_INDEX  # never a target: the previous document's last token predicts nothing
        positions[0, at : at + n] = torch.arange(n)
        mask[0, at : at + n] = 1
        at += n
    positions[0, at:] = torch.arange(width - at)
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "attention_mask": mask}


def shard_steps(
    steps: Iterable[list[MicroBatch]], rank: int, degree: int, pad_id: int = 0
) -> Iterator[list[MicroBatch]]:
    """Every micro-batch of every step of ``steps`` as rank ``rank``'s shard (``shard_micro_batch``)."""
    for micro_batches in steps:
        yield [shard_micro_batch(mb, rank, degree, pad_id) for mb in micro_batches]


class ContextShards:
    """A ``StepSource`` whose micro-batches are this context rank's shards of ``source``'s (the same data
    on every rank of a context group; the position in the data is ``source``'s, on any degree)."""

    def __init__(self, source: StepSource, rank: int, degree: int, pad_id: int = 0) -> None:
        self.source, self.rank, self.degree, self.pad_id = source, rank, degree, pad_id

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        return shard_steps(self.source, self.rank, self.degree, self.pad_id)

    def __getattr__(self, name: str) -> Any:  # lengths, total_steps: the source's
        if name == "source":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.source, name)

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)
