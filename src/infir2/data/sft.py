"""Supervised fine-tuning data: chat JSONL -> (input_ids, loss_mask) -> token-budgeted micro-batches.

File format (``load_conversations``): JSONL, one conversation per line::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}]}

Roles are ``system``, ``user``, ``assistant``; every conversation has at least one assistant turn.
Other keys on a line (an ``id``, say) are ignored.

Rendering: each conversation becomes ``(input_ids, loss_mask)`` by ``infir2.data.chat.render_conversation``
(the one chat renderer; the loss is on the assistant answers and their end-of-turn marker).

Batching (``SftSource``): a global batch is ``global_batch_size`` samples (per-epoch seeded shuffle).
They are spread over ranks longest first, each to the rank with the fewest tokens so far; on each
rank they are packed, longest first, into micro-batches whose padded size (longest x count) stays within
``max_tokens_per_micro_batch`` (the authors' ``max_tokens_per_gpu``). Ranks with fewer micro-batches get
padding micro-batches whose labels are all ``IGNORE_INDEX``, so every rank runs the same number of
forwards and FSDP's collectives line up.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from .._paths import jsonl_records
from .base import IGNORE_INDEX, MicroBatch
from .chat import Conversation, render_conversation
from .cpt import open_parquet

__all__ = [
    "ROLES",
    "SftSource",
    "load_conversations",
    "pack_micro_batches",
    "split_across_ranks",
]

ROLES = ("system", "user", "assistant")

log = logging.getLogger(__name__)

_DUMMY_LEN = 2  # tokens in a padding micro-batch (all labels IGNORE_INDEX)


# ----------------------------------------------------------------------------- loading


def load_conversations(path: str | Path) -> list[Conversation]:
    """Read a chat JSONL file, or a Parquet file with a ``messages`` column (as ``datasets`` writes chat
    data); any malformed line or row is a ``ValueError`` naming ``file:line`` / ``file: row N``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SFT data file not found: {path}")
    if path.suffix == ".parquet":
        return _load_parquet_conversations(path)
    conversations = [_parse_record(record, f"{path}:{n}") for n, record in jsonl_records(path)]
    if not conversations:
        raise ValueError(f'{path}: empty file (expected JSONL, one {{"messages": [...]}} object per line)')
    return conversations


def _load_parquet_conversations(path: Path) -> list[Conversation]:
    parquet = open_parquet(path)
    names = parquet.schema_arrow.names
    if "messages" not in names:
        raise ValueError(
            f"{path}: no column 'messages' (a list of {{role, content}} per row); columns are {names}"
        )
    rows = parquet.read(columns=["messages"]).column("messages").to_pylist()
    conversations = [_parse_record({"messages": m}, f"{path}: row {i}") for i, m in enumerate(rows, start=1)]
    if not conversations:
        raise ValueError(f"{path}: no rows")
    return conversations


def _parse_record(record: Any, where: str) -> Conversation:
    if not isinstance(record, dict) or "messages" not in record:
        raise ValueError(f"{where}: missing 'messages' (expected an object with a list of {{role, content}})")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    conversation = [_parse_message(m, f"{where}: messages[{i}]") for i, m in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in conversation):
        raise ValueError(f"{where}: conversation has no assistant turn (nothing to learn from)")
    return conversation


def _parse_message(message: Any, where: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise ValueError(
            f"{where}: expected an object with 'role' and 'content', got {type(message).__name__}"
        )
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise ValueError(f"{where}.role is {role!r}; expected one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string, got {type(content).__name__}")
    return {"role": role, "content": content}


# ----------------------------------------------------------------------------- batching


def split_across_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Positions of ``lengths`` per rank: longest first, each to the rank with the fewest tokens so far."""
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], len(ranks[r]), r))
        ranks[r].append(i)
        load[r] += lengths[i]
    return ranks


def pack_micro_batches(lengths: Sequence[int], positions: Sequence[int], budget: int) -> list[list[int]]:
    """Greedy, longest first: micro-batches of positions with ``longest * count <= budget``."""
    batches: list[list[int]] = []
    for i in sorted(positions, key=lambda i: (-lengths[i], i)):
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class SftSource:
    """Chat conversations as a ``StepSource``: finite, ``total_steps = steps_per_epoch * epochs``.

    ``overlong``: a sample longer than ``max_length`` tokens is cut to ``max_length`` (``"truncate"``)
    or left out (``"drop"``); samples left with no loss token are left out too. ``stats`` counts them.
    The last partial global batch of an epoch is not used.
    """

    def __init__(
        self,
        conversations: Sequence[Conversation],
        tokenizer: PreTrainedTokenizerBase,
        global_batch_size: int,
        max_tokens_per_micro_batch: int,
        max_length: int,
        overlong: str = "truncate",
        epochs: int = 1,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        progress: bool = True,
    ) -> None:
        _check_args(
            global_batch_size, max_tokens_per_micro_batch, max_length, overlong, epochs, rank, world_size
        )
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token (load it with infir2.data.load_tokenizer)")
        self.pad_id = int(tokenizer.pad_token_id)
        self.samples, self.stats = _render_all(conversations, tokenizer, max_length, overlong, progress)
        if len(self.samples) < global_batch_size:
            raise ValueError(
                f"{len(self.samples)} usable SFT samples (stats: {self.stats}) are fewer than "
                f"global_batch_size={global_batch_size}: not enough for one step"
            )
        self.lengths = [len(ids) for ids, _ in self.samples]
        self.global_batch_size, self.budget = global_batch_size, max_tokens_per_micro_batch
        self.epochs, self.seed, self.shuffle = epochs, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.steps_per_epoch = len(self.samples) // global_batch_size
        self.total_steps = self.steps_per_epoch * epochs
        self.epoch, self.step_in_epoch = 0, 0

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        while self.epoch < self.epochs:
            indices = self._step_indices(self.epoch, self.step_in_epoch)
            self.step_in_epoch += 1  # advance first: state_dict() taken after a step points at the next
            if self.step_in_epoch == self.steps_per_epoch:
                self.epoch, self.step_in_epoch = self.epoch + 1, 0
            yield self._micro_batches(indices)

    def _step_indices(self, epoch: int, step: int) -> list[int]:
        n = len(self.samples)
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        return [int(i) for i in order[step * self.global_batch_size : (step + 1) * self.global_batch_size]]

    def _micro_batches(self, indices: list[int]) -> list[MicroBatch]:
        lengths = [self.lengths[i] for i in indices]
        per_rank = split_across_ranks(lengths, self.world_size)
        packs = [pack_micro_batches(lengths, positions, self.budget) for positions in per_rank]
        count = max(len(p) for p in packs)
        mine = [self._collate([indices[p] for p in mb]) for mb in packs[self.rank]]
        return mine + [self._padding_batch() for _ in range(count - len(mine))]

    def _collate(self, sample_indices: list[int]) -> MicroBatch:
        width = max(self.lengths[i] for i in sample_indices)
        shape = (len(sample_indices), width)
        input_ids = torch.full(shape, self.pad_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        for row, i in enumerate(sample_indices):
            ids, mask = (torch.tensor(x, dtype=torch.long) for x in self.samples[i])
            input_ids[row, : len(ids)] = ids
            labels[row, : len(ids)] = torch.where(mask.bool(), ids, IGNORE_INDEX)
            attention_mask[row, : len(ids)] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}

    def _padding_batch(self) -> MicroBatch:
        shape = (1, _DUMMY_LEN)
        return {
            "input_ids": torch.full(shape, self.pad_id, dtype=torch.long),
            "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.long),
            "attention_mask": torch.ones(
                shape, dtype=torch.long
            ),  # real (ignored) tokens: no all-masked rows
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "seed": self.seed,
            "num_samples": len(self.samples),
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, now in (("num_samples", len(self.samples)), ("global_batch_size", self.global_batch_size)):
            if state[key] != now:
                raise ValueError(
                    f"cannot resume the SFT data position: {key} was {state[key]} and is now {now} "
                    f"(the data, max_length/overlong or the batch size changed)"
                )
        self.seed, self.epoch, self.step_in_epoch = state["seed"], state["epoch"], state["step_in_epoch"]


def _check_args(
    global_batch_size: int,
    budget: int,
    max_length: int,
    overlong: str,
    epochs: int,
    rank: int,
    world_size: int,
) -> None:
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    if min(global_batch_size, max_length, epochs, world_size) <= 0:
        raise ValueError(f"must be positive: {global_batch_size=} {max_length=} {epochs=} {world_size=}")
    if max_length > budget:
        raise ValueError(
            f"max_length={max_length} exceeds max_tokens_per_micro_batch={budget}: "
            f"a sample of max_length tokens must fit in one micro-batch"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")


def _render_all(
    conversations: Sequence[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    overlong: str,
    progress: bool,
) -> tuple[list[tuple[list[int], list[int]]], dict[str, int]]:
    stats = {"conversations": len(conversations), "samples": 0, "truncated": 0, "dropped_overlong": 0}
    stats |= {"dropped_no_loss": 0, "tokens": 0, "loss_tokens": 0}
    samples = []
    for messages in tqdm(conversations, desc="rendering SFT data", unit=" conv", disable=not progress):
        ids, mask = render_conversation(tokenizer, messages)
        if len(ids) > max_length:
            if overlong == "drop":
                stats["dropped_overlong"] += 1
                continue
            ids, mask = ids[:max_length], mask[:max_length]
            stats["truncated"] += 1
        if sum(mask[1:]) == 0:  # position 0 is never a target after the shift
            stats["dropped_no_loss"] += 1
            continue
        samples.append((ids, mask))
        stats["samples"] += 1
        stats["tokens"] += len(ids)
        stats["loss_tokens"] += sum(mask)
    if stats["truncated"] or stats["dropped_overlong"] or stats["dropped_no_loss"]:
        log.info("SFT data: %s", stats)
    return samples, stats
