"""Data: CPT token files (prepare, read), chat rendering, SFT batching, tokenizers."""

from .base import IGNORE_INDEX, MicroBatch, StepSource, count_loss_tokens, left_pad_positions
from .chat import SYSTEM_PROMPT, assistant_spans, render_conversation, render_prompt, stop_token_ids
from .chat_template import CHATML_SPECIAL_TOKENS, DEFAULT_CHAT_TEMPLATE
from .cpt import prepare_cpt
from .sft import SftSource, load_conversations
from .tokenizer import first_difference, folder_model_type, load_tokenizer, train_bpe_tokenizer
from .tokens import CptSource, check_tokenized_by, load_cpt_meta, load_tokens, val_batches

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
    "check_tokenized_by",
    "count_loss_tokens",
    "first_difference",
    "folder_model_type",
    "left_pad_positions",
    "load_conversations",
    "load_cpt_meta",
    "load_tokenizer",
    "load_tokens",
    "prepare_cpt",
    "render_conversation",
    "render_prompt",
    "stop_token_ids",
    "train_bpe_tokenizer",
    "val_batches",
]
