"""Held-out loss and perplexity of a causal LM on a token file (for CPT checkpoints).

The token file is ``<dir>/<split>.bin`` with ``<dir>/meta.json``, read by ``infir2.data.load_tokens``
(the layout ``infir2 prepare-cpt`` writes). Its windows are ``infir2.data.val_batches``' held-out
windows -- ``seq_len + 1`` tokens sharing their boundary token, so every token after the first is
predicted exactly once from up to ``seq_len`` tokens of context, a trailing partial window included --
and the loss is ``infir2.loss.heldout_loss``: the sum of token cross-entropies (fp32 logits) over the
number of predicted tokens; perplexity = exp(loss). Training's validation loss uses the same two
functions, so a CPT run's ``val_loss`` (all windows evaluated) is the number this prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.tokens import load_tokens, val_batches
from ..loss import heldout_loss

__all__ = ["LossResult", "check_loss_inputs", "evaluate_loss"]


@dataclass(frozen=True)
class LossResult:
    loss: float
    perplexity: float
    tokens: int  # predicted tokens

    def as_dict(self) -> dict[str, float | int]:
        return {"loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens}


def check_loss_inputs(
    token_dir: str | Path,
    split: str,
    seq_len: int,
    max_windows: int | None,
    vocab: int | None = None,
    positions: int | None = None,
) -> None:
    """Refuse what a model of ``vocab`` token ids and ``positions`` trained positions cannot score: a token
    file that does not read, no window at all, windows past the positions, token ids past the vocabulary.
    ``infir2 eval --perplexity`` calls it with config.json's numbers before any weights are read."""
    tokens = load_tokens(token_dir, split)
    if seq_len < 1:
        raise ValueError(f"seq_len (--seq-len) must be >= 1, got {seq_len}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows (--max-windows) must be >= 1, got {max_windows}")
    if isinstance(positions, int) and seq_len > positions:
        raise ValueError(
            f"seq_len (--seq-len) {seq_len} is past the {positions} positions the model was trained for "
            "(max_position_embeddings): its loss there says nothing about the model; shorten it"
        )
    if vocab is not None and len(tokens) and int(tokens.max()) >= vocab:
        raise ValueError(
            f"{token_dir}/{split}.bin holds token id {int(tokens.max())} >= the model's vocab_size {vocab}"
        )


def evaluate_loss(
    model: torch.nn.Module,
    token_dir: str | Path,
    seq_len: int = 1024,
    batch_size: int = 4,
    max_windows: int | None = None,
    split: str = "val",
    fp8: bool = False,
) -> LossResult:
    """Token-weighted mean cross-entropy over ``<token_dir>/<split>.bin`` (see the module docstring)."""
    config = getattr(model, "config", None)
    vocab, positions = getattr(config, "vocab_size", None), getattr(config, "max_position_embeddings", None)
    check_loss_inputs(token_dir, split, seq_len, max_windows, vocab, positions)
    batches = val_batches(token_dir, seq_len, batch_size, split=split, max_windows=max_windows)
    loss, count = heldout_loss(model, ([mb] for mb in batches), fp8=fp8, progress=True)
    return LossResult(loss=loss, perplexity=math.exp(loss), tokens=count)
