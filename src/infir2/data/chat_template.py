"""The default chat template, used when a tokenizer has none: ChatML, as Qwen2.5 writes it.

    <|im_start|>system\n{content}<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n
    <|im_start|>assistant\n{content}<|im_end|>\n

With ``add_generation_prompt`` the text ends with ``<|im_start|>assistant\n``.
"""

from __future__ import annotations

__all__ = ["CHATML_SPECIAL_TOKENS", "DEFAULT_CHAT_TEMPLATE"]

CHATML_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
