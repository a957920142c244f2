"""The shipped config of a real mixture of experts (Qwen3-30B-A3B SFT): `infir2 config` checks it and
`infir2 plan` plans it from the model folder it names; at a tiny stand-in size it trains as shipped
(bf16 autocast, activation checkpointing, sharded async checkpoints, FP8 experts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import infir2
from infir2.cli import main
from moe_models import make_tiny_moe, moe_config, qwen3_30b_a3b_config
from train_synthetic import one_thread

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

_one_thread = pytest.fixture(autouse=True)(one_thread)

CONFIG = Path(infir2.__file__).parent / "configs" / "qwen3-30b-a3b-sft.yaml"
FOLDER = "models/Qwen3-30B-A3B"  # what the shipped config's model.path names


def test_config_checks_and_plans_from_the_folder_it_names(tmp_path, monkeypatch, capsys):
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / FOLDER
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(qwen3_30b_a3b_config().to_dict(), default=str))
    save_file({"stand_in": torch.zeros(1)}, folder / "model.safetensors")  # the checks read headers only
    assert main(["config", "qwen3-30b-a3b-sft", "--world-size", "8"]) == 2  # no data yet: named
    assert "data.train_path: SFT data file data/sft-stage1.jsonl does not exist" in capsys.readouterr().err
    (tmp_path / "data").mkdir()
    (tmp_path / "data/sft-stage1.jsonl").write_text('{"messages": []}\n')
    assert main(["config", "qwen3-30b-a3b-sft", "--world-size", "8"]) == 0
    resolved = capsys.readouterr().out
    assert f"path: {FOLDER}" in resolved and "recipe: blockwise" in resolved
    plan = ["--gpus", "8", "--seq-len", "32768", "--activation-checkpointing", "--gpu", "h200"]
    assert main(["plan", FOLDER, *plan]) == 0
    from_folder = capsys.readouterr().out
    assert main(["plan", "qwen3-30b-a3b", *plan]) == 0
    shipped = capsys.readouterr().out
    assert "30.53B parameters (3.35B active: 8 of 128 experts per layer)" in from_folder
    assert from_folder.splitlines()[1:] == shipped.splitlines()[1:]  # same plan, whichever way named
    assert "fits a H200" in shipped


@pytest.mark.slow
def test_config_trains_as_shipped_on_a_tiny_stand_in(tmp_path, monkeypatch):
    """A 2-layer Qwen3-MoE (heads wider than hidden / heads, as the real one) in the folder the config
    names, the demo's chat data: two steps of the config unchanged but for sizes, device and steps."""
    from transformers import AutoModelForCausalLM

    from infir2.data.tokenizer import load_tokenizer
    from infir2.export import load_checkpoint

    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--data-only", "--quick", "--out", "runs/tiny"]) == 0
    tokenizer = load_tokenizer("runs/tiny/tokenizer")
    config = moe_config("qwen3_moe")
    config.vocab_size, config.head_dim = len(tokenizer), 96
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(FOLDER)
    tokenizer.save_pretrained(FOLDER)
    tiny = {
        "data.train_path": "runs/tiny/data/sft_train_split.jsonl",
        "data.global_batch_size": 4,
        "data.max_tokens_per_micro_batch": 1024,
        "data.max_length": 512,
        "train.max_steps": 2,
        "train.save_every": 1,
        "run.device": "cpu",
    }
    overrides = [a for k, v in tiny.items() for a in ("--set", f"{k}={v}")]
    assert main(["train", "qwen3-30b-a3b-sft", "--no-progress", *overrides]) == 0
    rows = [
        json.loads(r) for r in (tmp_path / "runs/qwen3-30b-a3b-sft/metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if "loss" in r)
    model = load_checkpoint(tmp_path / "runs/qwen3-30b-a3b-sft/hf")
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.head_dim == 96


@pytest.mark.parametrize("asks", [True, False])
def test_a_config_asking_for_the_router_loss_is_told_it_is_not_added(caplog, asks):
    """infir2's loss is the next-token cross-entropy alone; a config with ``output_router_logits`` is warned."""
    import logging

    from infir2.harness.setup import warn_router_loss

    model = make_tiny_moe("qwen3_moe")
    model.config.output_router_logits = asks
    with caplog.at_level(logging.WARNING, logger="infir2.harness.setup"):
        warn_router_loss(model)
    said = [r.getMessage() for r in caplog.records if "load-balancing loss is not added" in r.getMessage()]
    assert len(said) == (1 if asks else 0)
    if asks:
        assert f"router_aux_loss_coef {model.config.router_aux_loss_coef}" in said[0]
