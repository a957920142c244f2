"""The contract between data sources and the training loop.

A data source yields, for each optimizer step, the list of micro-batches that *this rank* runs
(forward + backward each, gradients accumulated). Every rank gets the same number of micro-batches
per step (a source pads with micro-batches whose labels are all ``IGNORE_INDEX``), so that FSDP's
collectives line up. A micro-batch is a dict of tensors:

* ``input_ids``  ``[B, L]`` int64
* ``labels``     ``[B, L]`` int64, aligned with ``input_ids`` (Hugging Face convention: the loop
  shifts), ``IGNORE_INDEX`` where no loss is taken (prompt tokens, padding)
* ``attention_mask`` ``[B, L]`` int64, optional (1 = real token; right padding)
* ``position_ids`` ``[B, L]`` int64, optional: packed documents (restarting at 0 at each document)

A context-parallel shard (``data.context.shard_micro_batch``) holds ``shift_labels`` (already shifted
on the whole sequence) in place of ``labels``, and the whole row's ``documents``.

The loop normalises the summed token loss by the number of loss tokens in the whole global batch
(all micro-batches, all ranks): a per-token mean, as the recipe asks.

``state_dict()`` / ``load_state_dict()`` capture the position in the data, so that a resumed run
yields exactly the steps an uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["IGNORE_INDEX", "MicroBatch", "StepSource", "count_loss_tokens", "left_pad_positions"]

IGNORE_INDEX = -100

MicroBatch = dict[str, torch.Tensor]


@runtime_checkable
class StepSource(Protocol):
    def __iter__(self) -> Iterator[list[MicroBatch]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def count_loss_tokens(micro_batches: list[MicroBatch]) -> int:
    """Tokens that carry loss after the one-position shift (labels[:, 1:] != IGNORE_INDEX; a context
    shard's ``shift_labels``, shifted on the whole sequence, as they are)."""
    return int(sum(_targets(mb).ne(IGNORE_INDEX).sum() for mb in micro_batches))


def _targets(mb: MicroBatch) -> torch.Tensor:
    return mb["shift_labels"] if "shift_labels" in mb else mb["labels"][:, 1:]


def left_pad_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch from its attention ``mask`` (``[B, L]``, 1 = real token):
    each row counts from 0 at its first real token; padding columns take 0. The one rule of the
    sampler's prompts and of RL's scoring and update, so that the trainer scores each token at the
    position the engine generated it at (the mismatch metric compares the two)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)
