"""Chat rendering, the one place: training conversations, evaluation prompts, and where generation stops.

Every chat text is rendered with the tokenizer's chat template (``DEFAULT_CHAT_TEMPLATE``, ChatML, when
it has none) by ``render_chat``; SFT (``render_conversation``), evaluation (``render_prompt``) and the
export's generation config (``stop_token_ids``) all go through this module, so a model is trained,
prompted and stopped with the same markers.

Training (``render_conversation``): the conversation is rendered and tokenized once. The loss mask is 1
on each assistant turn's content *and* its closing end-of-turn marker (``<|im_end|>`` in ChatML: the
model must learn to stop) and 0 on everything else: system and user turns and the
``<|im_start|>assistant\\n`` header. The spans are found from the template itself, not from ChatML
assumptions: for assistant message ``i``, the text rendered for ``messages[:i]`` with the generation
prompt ends where the answer begins, and the text rendered for ``messages[:i+1]`` (trailing whitespace
removed) ends where it ends. Both must be prefixes of the full text (true of ChatML, Llama 3 and Qwen
templates; a template that rewrites earlier turns is rejected with an error). Tokens are then assigned
by their character offsets: a token carries loss when it starts inside an assistant span.

Evaluation (``render_prompt``) follows the authors' protocol: a system turn with :data:`SYSTEM_PROMPT`,
the user turn, the template's generation prompt (``<|im_start|>assistant\\n`` for ChatML), and the
assistant turn opened with :data:`THINK_PREFIX` so the model starts by reasoning. Generation stops at
:data:`STOP_TOKENS` (those the vocabulary has) or the tokenizer's eos.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from .chat_template import DEFAULT_CHAT_TEMPLATE

__all__ = [
    "STOP_TOKENS",
    "SYSTEM_PROMPT",
    "THINK_PREFIX",
    "Conversation",
    "assistant_spans",
    "render_chat",
    "render_conversation",
    "render_prompt",
    "stop_token_ids",
]

#: The authors' system prompt (training data of the demo and evaluation prompts alike).
SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
#: What an evaluation prompt opens the assistant turn with.
THINK_PREFIX = "<think>\n"
#: End-of-turn markers generation stops at (besides the tokenizer's eos), in this order.
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")

Conversation = list[dict[str, str]]


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Conversation, generation_prompt: bool) -> str:
    """The text of ``messages`` under the tokenizer's chat template (ChatML when it has none)."""
    text = tokenizer.apply_chat_template(
        messages,
        chat_template=tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE,
        tokenize=False,
        add_generation_prompt=generation_prompt,
    )
    assert isinstance(text, str)
    return text


def assistant_spans(
    tokenizer: PreTrainedTokenizerBase, messages: Conversation
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and, per assistant turn, the character span [start, end) that carries loss.

    The span starts after the assistant header and ends after the end-of-turn marker (trailing
    whitespace the template adds between turns is excluded).
    """
    text = render_chat(tokenizer, messages, generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], generation_prompt=True)
        through = render_chat(tokenizer, messages[: i + 1], generation_prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                f"the chat template does not render conversations prefix by prefix (assistant turn {i}): "
                f"cannot locate the assistant spans; use a template that does (e.g. the default ChatML)"
            )
        start, end = len(before), len(through.rstrip())
        if message["content"].strip() not in text[start:end]:
            raise ValueError(f"the chat template drops or rewrites the content of assistant turn {i}")
        spans.append((start, end))
    return text, spans


def render_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: Conversation, max_length: int | None = None
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of one conversation; ``loss_mask[j] = 1`` on assistant answers + end marker.

    ``max_length`` cuts both lists (truncation from the right).
    """
    text, spans = assistant_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids: list[int] = list(encoding["input_ids"])
    loss_mask = [int(any(s <= start < e for s, e in spans)) for start, _ in encoding["offset_mapping"]]
    if max_length is not None:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return input_ids, loss_mask


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    user_message: str,
    system_prompt: str | None = SYSTEM_PROMPT,
    think_prefix: str = THINK_PREFIX,
) -> str:
    """The full evaluation prompt: system + user turn, the generation prompt, then ``think_prefix``."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": user_message})
    return render_chat(tokenizer, messages, generation_prompt=True) + think_prefix


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids generation stops at: those of ``STOP_TOKENS`` in the vocabulary (in that order), then eos.

    Empty when the tokenizer has none of them (the caller decides whether that is an error).
    """
    vocab = tokenizer.get_vocab()
    stops = [vocab[t] for t in STOP_TOKENS if t in vocab]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
        stops.append(tokenizer.eos_token_id)
    return stops
