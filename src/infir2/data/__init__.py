"""Data: CPT token shards, SFT chat rendering and batching, tokenizers, the demo data."""

from .base import IGNORE_INDEX, MicroBatch, StepSource, count_loss_tokens
from .chat_template import DEFAULT_CHAT_TEMPLATE

__all__ = ["DEFAULT_CHAT_TEMPLATE", "IGNORE_INDEX", "MicroBatch", "StepSource", "count_loss_tokens"]
