"""Shared fixtures: a tiny tokenizer trained in-process and tiny Qwen2 / Llama models (no download), and
``cli_fails``, the check of a command refused in one line."""

from __future__ import annotations

import pytest
import torch

from infir2.data.chat_template import CHATML_SPECIAL_TOKENS, DEFAULT_CHAT_TEMPLATE

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. 12 + 30 = 42.",
    "In the beginning was the word, and the word was with numbers: 7 * 6 = 42.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
] * 20


def make_tokenizer(vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHATML_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = DEFAULT_CHAT_TEMPLATE
    return fast


#: dense families the tests build beyond ``infir2.model.ARCHS`` (arch -> config and model class names)
_MORE_ARCHS = {
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def make_tiny_model(
    arch: str = "qwen2",
    vocab_size: int = 300,
    hidden: int = 128,
    layers: int = 2,
    seed: int = 0,
    *,
    intermediate: int | None = None,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int | None = 512,
    tie: bool = False,
    **config,
):
    """A randomly initialized fp32 causal LM of ``arch`` (a name of ``infir2.model.ARCHS`` -- qwen2,
    llama -- or mistral, phi3, qwen3; ``torch.manual_seed(seed)`` first), untied embeddings unless
    ``tie``. ``intermediate`` defaults to ``2 * hidden + 128``; ``max_positions=None`` keeps the HF
    config's own default; ``config`` goes to the HF config as is (token ids, ...). The one builder of the
    tests' and benchmarks' hand-made models."""
    import transformers

    from infir2.model import ARCHS

    cfg_name, model_name = {**ARCHS, **_MORE_ARCHS}[arch]
    positions = {} if max_positions is None else {"max_position_embeddings": max_positions}
    cfg = getattr(transformers, cfg_name)(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 128 if intermediate is None else intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tie,
        **positions,
        **config,
    )
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(cfg).float()


def cli_fails(capsys, argv: list[str], *expected: str) -> str:
    """Run ``infir2 argv``: exit code 2, exactly one error line holding every ``expected`` text, no
    traceback; returns the line."""
    from infir2.cli import main

    rc = main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert all(text in errors[0] for text in expected), errors[0]
    return errors[0]


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture
def tiny_qwen2():
    return make_tiny_model("qwen2")
