"""The in-process BPE tokenizer and the local tokenizer loader."""

from __future__ import annotations

import json

import pytest

from infir2.data import CHATML_SPECIAL_TOKENS, DEFAULT_CHAT_TEMPLATE, load_tokenizer, train_bpe_tokenizer

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

TEXTS = [
    "Compute 37 + 48 - 19. The answer is 66.",
    "Numbers like 123456 and 2024 are split digit by digit.",
] * 50


@pytest.fixture(scope="module")
def bpe():
    return train_bpe_tokenizer(TEXTS, vocab_size=400)


def test_digits_are_single_tokens(bpe):
    tokens = bpe.convert_ids_to_tokens(bpe("x 9876543210 y", add_special_tokens=False)["input_ids"])
    digit_tokens = [t for t in tokens if any(c.isdigit() for c in t)]
    assert digit_tokens == list("9876543210")


def test_round_trip_and_specials(bpe):
    text = "Grüße, 東京! 37+48=85\n\ttabs <|im_start|>user\nhi<|im_end|>"
    ids = bpe(text, add_special_tokens=False)["input_ids"]
    assert bpe.decode(ids) == text  # byte-level: anything round-trips
    assert bpe.convert_tokens_to_ids(CHATML_SPECIAL_TOKENS) == [0, 1, 2]
    assert bpe.eos_token == bpe.pad_token == "<|endoftext|>"
    assert bpe.convert_tokens_to_ids("<|im_end|>") in ids  # specials are single tokens inside text
    assert bpe.chat_template == DEFAULT_CHAT_TEMPLATE


def test_vocab_too_small_is_an_error():
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        train_bpe_tokenizer(TEXTS, vocab_size=100)


def test_save_and_load(bpe, tmp_path):
    bpe.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded("37 + 48")["input_ids"] == bpe("37 + 48")["input_ids"]
    assert loaded.chat_template == DEFAULT_CHAT_TEMPLATE


def test_load_fills_missing_template_and_pad(bpe, tmp_path, caplog):
    bpe.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config.pop("pad_token", None)
    config_path.write_text(json.dumps(config))
    with caplog.at_level("INFO"):
        loaded = load_tokenizer(tmp_path)
    assert loaded.chat_template == DEFAULT_CHAT_TEMPLATE
    assert "no chat template" in caplog.text
    assert loaded.pad_token is not None


def test_load_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(tmp_path / "nope")
