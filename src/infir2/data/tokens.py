"""Reading prepared token folders: the one token reader, training windows, held-out windows.

A folder written by ``infir2 prepare-cpt`` (``infir2.data.cpt``) holds ``train.bin`` / ``val.bin``
(raw little-endian token ids, dtype ``meta.json["dtype"]``: ``uint16`` or ``uint32``) and ``meta.json``.

Training (``CptSource``): the token stream is cut into non-overlapping windows of ``seq_len`` tokens
(the tail that does not fill a window is unused). Each epoch visits the windows in a seeded random
order; each optimizer step takes the next ``global_batch_size`` windows, split evenly across ranks and
then into micro-batches of ``micro_batch_size``. Labels equal the inputs (the loop shifts). The position
(epoch, step in epoch, seed) is the state dict, so a resumed run sees exactly the windows an
uninterrupted run would.

Held-out loss (``val_batches``, used by training's validation *and* ``infir2 eval --perplexity``, so
both print the same number): consecutive windows of ``seq_len + 1`` tokens that share their boundary
token, so every token after the first is predicted exactly once from up to ``seq_len`` tokens of
context::

    window w: tokens[w*L : w*L + L + 1]  ->  inputs = its first L, targets = its last L (after the shift)

A trailing partial window is scored too (right-padded; padding has ``attention_mask`` 0 and
``IGNORE_INDEX`` labels). Documents are not isolated (the eos separator is just a token), which matches
how CPT trains on packed sequences.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .base import IGNORE_INDEX, MicroBatch

__all__ = [
    "META_FILE",
    "TOKEN_DTYPES",
    "CptSource",
    "check_batch_sizes",
    "check_tokenized_by",
    "heldout_windows",
    "load_cpt_meta",
    "load_tokens",
    "val_batches",
]

META_FILE = "meta.json"
#: ``meta.json["dtype"]`` -> numpy dtype of the token files
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def load_cpt_meta(data_dir: str | Path) -> dict[str, Any]:
    """``meta.json`` of a prepared folder (error if the folder is missing or incomplete)."""
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: prepare the data with `infir2 prepare-cpt` first")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg})") from None
    dtype = meta.get("dtype") if isinstance(meta, dict) else None
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"{path}: key 'dtype' must be one of {sorted(TOKEN_DTYPES)}, got {dtype!r}")
    return meta


def load_tokens(data_dir: str | Path, split: str = "train") -> np.ndarray:
    """The token ids of ``<data_dir>/<split>.bin`` as a read-only memmap (dtype from ``meta.json``).

    The one token reader: training windows, held-out windows and ``infir2 eval --perplexity`` all read
    through it.
    """
    meta = load_cpt_meta(data_dir)
    path = Path(data_dir) / f"{split}.bin"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    size = path.stat().st_size
    if size == 0:
        return np.zeros(0, dtype=dtype)
    if size % dtype.itemsize:
        raise ValueError(
            f"{path}: {size} bytes is not a whole number of {meta['dtype']} tokens ({dtype.itemsize} bytes "
            "each, meta.json's dtype): the file is cut short or not this folder's; run `infir2 prepare-cpt` again"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def check_tokenized_by(
    tokenizer: Any, data_dir: str | Path, documents: int = 8, max_tokens: int = 65536
) -> None:
    """Refuse shards that ``tokenizer`` would not have produced: its export would tokenize differently.

    The first ``documents`` documents of ``train.bin`` (eos-separated, at most ``max_tokens`` tokens)
    are decoded and re-encoded with ``tokenizer``; byte-level BPE round-trips exactly, so any
    difference means ``prepare-cpt`` used another tokenizer (or another reading of the same folder).
    """
    eos = tokenizer.eos_token_id
    tokens = load_tokens(data_dir, "train")[:max_tokens]
    ends = np.flatnonzero(tokens == eos)[:documents] if eos is not None else np.zeros(0, dtype=np.int64)
    start = 0
    for index, end in enumerate(ends.tolist()):
        ids = tokens[start:end].tolist()
        start = end + 1
        again = tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"]
        if again != ids:
            raise ValueError(
                f"data.train_path: {data_dir}/train.bin was not tokenized the way this run's tokenizer "
                f"({type(tokenizer).__name__}, {tokenizer.name_or_path}) tokenizes: document {index} "
                f"({len(ids)} tokens) re-encodes to {len(again)} tokens. The exported model would read text "
                "differently from what it trained on; re-run `infir2 prepare-cpt` with the model's folder as "
                "--tokenizer (or --model-type of the model)"
            )


def _window_batch(tokens: np.ndarray, windows: np.ndarray, seq_len: int) -> MicroBatch:
    rows = np.stack([tokens[w * seq_len : (w + 1) * seq_len] for w in windows]).astype(np.int64)
    input_ids = torch.from_numpy(rows)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


class CptSource:
    """Fixed-length training windows of a prepared folder; a ``StepSource`` (infinite: the loop stops it).

    Each step: ``global_batch_size`` windows; this rank takes its contiguous ``global_batch_size //
    world_size`` of them, in micro-batches of ``micro_batch_size``. The global order does not depend on
    ``world_size``, so a run may resume on a different number of ranks.
    """

    def __init__(
        self,
        data_dir: str | Path,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        check_batch_sizes(global_batch_size, micro_batch_size, rank, world_size)
        self.tokens = load_tokens(data_dir, "train")
        self.seq_len = seq_len
        self.num_windows = len(self.tokens) // seq_len
        if self.num_windows < global_batch_size:
            raise ValueError(
                f"{data_dir}: {len(self.tokens)} training tokens make {self.num_windows} windows of "
                f"seq_len={seq_len}, but one step needs global_batch_size={global_batch_size} windows"
            )
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.steps_per_epoch = self.num_windows // global_batch_size
        self.tokens_per_step = global_batch_size * seq_len
        self.seed = seed
        self.epoch = 0
        self.step_in_epoch = 0
        self._order_key: tuple[int, int] | None = None
        self._order = np.zeros(0, dtype=np.int64)

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        while True:
            windows = self._step_windows(self.epoch, self.step_in_epoch)
            self.step_in_epoch += 1  # advance first: state_dict() taken after a step points at the next
            if self.step_in_epoch == self.steps_per_epoch:
                self.epoch, self.step_in_epoch = self.epoch + 1, 0
            yield [
                _window_batch(self.tokens, windows[i : i + self.micro_batch_size], self.seq_len)
                for i in range(0, len(windows), self.micro_batch_size)
            ]

    def _step_windows(self, epoch: int, step: int) -> np.ndarray:
        if self._order_key != (self.seed, epoch):  # one permutation per epoch, cached
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._order_key = (self.seed, epoch)
        order = self._order
        step_windows = order[step * self.global_batch_size : (step + 1) * self.global_batch_size]
        per_rank = self.global_batch_size // self.world_size
        return step_windows[self.rank * per_rank : (self.rank + 1) * per_rank]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_windows": self.num_windows,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seq_len", "num_windows", "global_batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the CPT data position: {key} was {state[key]} and is now "
                    f"{getattr(self, key)} (the data or the batch shape changed)"
                )
        self.seed, self.epoch, self.step_in_epoch = state["seed"], state["epoch"], state["step_in_epoch"]


def check_batch_sizes(global_batch_size: int, micro_batch_size: int, rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if global_batch_size <= 0 or micro_batch_size <= 0:
        raise ValueError(f"batch sizes must be positive, got {global_batch_size=} {micro_batch_size=}")
    if global_batch_size % world_size:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by world_size={world_size}")
    per_rank = global_batch_size // world_size
    if per_rank % micro_batch_size:
        raise ValueError(
            f"global_batch_size / world_size = {per_rank} windows per rank is not divisible by "
            f"micro_batch_size={micro_batch_size}"
        )


def heldout_windows(n_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """Token spans ``[start, end)`` of the held-out windows: ``seq_len + 1`` tokens, sharing boundaries."""
    return [(s, min(s + seq_len + 1, n_tokens)) for s in range(0, n_tokens - 1, seq_len)]


def _span_batch(tokens: np.ndarray, spans: list[tuple[int, int]]) -> MicroBatch:
    width = max(e - s for s, e in spans)
    input_ids = torch.zeros((len(spans), width), dtype=torch.long)
    attention_mask = torch.zeros((len(spans), width), dtype=torch.long)
    for row, (s, e) in enumerate(spans):
        input_ids[row, : e - s] = torch.from_numpy(np.asarray(tokens[s:e], dtype=np.int64))
        attention_mask[row, : e - s] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)  # right padding carries no loss
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def val_batches(
    data_dir: str | Path,
    seq_len: int,
    batch_size: int,
    max_batches: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    split: str = "val",
    max_windows: int | None = None,
) -> Iterator[MicroBatch]:
    """The held-out windows of ``<data_dir>/<split>.bin`` in order, ``batch_size`` at a time.

    ``max_windows`` / ``max_batches`` keep only the first ones. With several ranks, batch ``i`` goes to
    rank ``i % world_size``; where the count is not a multiple of ``world_size`` the last ranks get one
    empty batch each (the first window with no loss token), so that every rank runs the same number of
    forwards (FSDP's collectives) and the ranks together score exactly the windows one process scores.
    """
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    tokens = load_tokens(data_dir, split)
    if len(tokens) < 2:
        raise ValueError(
            f"{data_dir}/{split}.bin has {len(tokens)} tokens: a held-out loss needs at least 2 "
            f"(prepare with a larger --val-fraction)"
        )
    spans = heldout_windows(len(tokens), seq_len)[:max_windows]
    starts = list(range(0, len(spans), batch_size))[:max_batches]
    padded = -(-len(starts) // world_size) * world_size
    for i in range(rank, padded, world_size):
        if i < len(starts):
            yield _span_batch(tokens, spans[starts[i] : starts[i] + batch_size])
        else:  # same forward as a real batch, no loss token: the totals are those of the real ones
            empty = _span_batch(tokens, spans[:1])
            yield {**empty, "labels": torch.full_like(empty["labels"], IGNORE_INDEX)}
