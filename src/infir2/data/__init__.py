"""Data: CPT token shards, SFT chat rendering and batching, tokenizers, the demo data."""

from .base import IGNORE_INDEX, MicroBatch, StepSource, count_loss_tokens
from .chat_template import CHATML_SPECIAL_TOKENS, DEFAULT_CHAT_TEMPLATE
from .cpt import CptSource, load_cpt_meta, load_tokens, prepare_cpt, val_batches
from .demo import SYSTEM_PROMPT, make_demo_data
from .sft import SftSource, assistant_spans, load_conversations, render_conversation
from .tokenizer import load_tokenizer, train_bpe_tokenizer

__all__ = [
    "CHATML_SPECIAL_TOKENS",
    "DEFAULT_CHAT_TEMPLATE",
    "IGNORE_INDEX",
    "SYSTEM_PROMPT",
    "CptSource",
    "MicroBatch",
    "SftSource",
    "StepSource",
    "assistant_spans",
    "count_loss_tokens",
    "load_conversations",
    "load_cpt_meta",
    "load_tokenizer",
    "load_tokens",
    "make_demo_data",
    "prepare_cpt",
    "render_conversation",
    "train_bpe_tokenizer",
    "val_batches",
]
