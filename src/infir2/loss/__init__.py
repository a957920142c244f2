"""Scoring tokens under a causal LM's head, defined once: training's loss, validation, ``infir2 eval
--perplexity`` and RL's log-probabilities and entropies.

* ``scorer`` -- ``score_tokens``: each target token's log-probability (and the entropy) at a temperature,
  chunked over tokens under a memory budget (``chunk_tokens_for``; the backward recomputes each chunk's
  logits), never the full fp32 ``[tokens, vocab]`` logits above it;
* ``cross_entropy`` -- ``token_ce_sum`` (a micro-batch's summed next-token CE: the training step's loss;
  a context shard's pre-shifted labels), ``heldout_loss`` (validation and ``infir2 eval --perplexity``:
  one definition, one number) and ``shard_context``.

The package sits beside ``model.py`` (it imports data, model and nn) so that train, eval and rl, which
may not import each other, share it.
"""

from .cross_entropy import heldout_loss, lm_loss_sum, shard_context, token_ce_sum
from .scorer import (
    AUTO_CHUNK_BYTES,
    auto_chunk_tokens,
    chunk_tokens_for,
    chunked_token_scores,
    linear_cross_entropy_sum,
    score_tokens,
)

__all__ = [
    "AUTO_CHUNK_BYTES",
    "auto_chunk_tokens",
    "chunk_tokens_for",
    "chunked_token_scores",
    "heldout_loss",
    "linear_cross_entropy_sum",
    "lm_loss_sum",
    "score_tokens",
    "shard_context",
    "token_ce_sum",
]
