"""The config.json of an export is what an inference engine needs: a model built from a config (as
`train` does from `model.from_config`) names its architecture, keeps the KV cache on as its
generation config says, and has no bos token its tokenizer lacks."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from conftest import make_tokenizer
from infir2.export import export_model
from infir2.model import build_from_config, prepare_for_training

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers


def test_a_from_config_export_names_its_architecture_and_caches(tmp_path):
    tokenizer = make_tokenizer()
    assert tokenizer.bos_token_id is None
    model = build_from_config(
        {
            "arch": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        vocab_size=len(tokenizer),
        seed=0,
    )
    model = prepare_for_training(model, "blockwise", None, False, True)  # as training leaves it
    out = export_model(model, tokenizer, tmp_path / "hf", fmt="fp32")
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["use_cache"] is True and generation.get("use_cache", True) is True
    assert config.get("bos_token_id") is None and generation.get("bos_token_id") is None
    assert AutoConfig.from_pretrained(out).architectures == ["Qwen2ForCausalLM"]
    assert GenerationConfig.from_pretrained(out).bos_token_id is None
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "Qwen2ForCausalLM"
    assert model.config.use_cache is False  # the training model itself is left as it was
