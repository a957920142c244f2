"""RL at the size it ships for, checked small: one RL step allocates no full-vocabulary block beyond the
scorer's chunk (bytes counted per allocation, not time), and the chunked step's numbers equal the
unchunked step's; every shipped config loads, RL's included; ``infir2 plan --rl`` runs on the shipped RL
configs and its RL terms (engine, reference, KV cache) match the tensors of a tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import infir2
import infir2.loss.scorer as scorer
from conftest import make_tiny_model
from infir2.cli import main
from infir2.rl import loop as rl_loop
from infir2.rl import parse_rl_config, rl
from infir2.rl.config import load_rl_config, save_rl_config
from infir2.rl.plan_inputs import plan_inputs
from infir2.tools.plan import ModelShape, plan_rl
from infir2.train.config import RunConfig, load_config
from rl_runs import one_step_config
from train_synthetic import one_thread

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

_one_thread = pytest.fixture(autouse=True)(one_thread)

VOCAB, HIDDEN, RESPONSE, GROUP = 1000, 64, 48, 2


class VocabBlocks(TorchDispatchMode):
    """The bytes of the largest tensor with a last dimension of ``vocab`` that any op allocates, and the
    rows (tokens) it had: a ``[*, V]`` block of logits, probabilities or their gradient. The head's
    weight-shaped ``[H, V]`` tensors (its transpose, its gradient) are the weight's size, not the tokens'."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden, self.bytes, self.rows = vocab, hidden, 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.shape in ((self.hidden, self.vocab), (self.vocab,)):
                continue
            vocab_block = t.dim() >= 2 and t.shape[-1] == self.vocab
            if vocab_block and t.untyped_storage().nbytes() > self.bytes:
                self.bytes, self.rows = t.untyped_storage().nbytes(), t.numel() // self.vocab
        return out


def _step(tmp_path, name: str, tok, blocks: VocabBlocks, monkeypatch) -> dict[str, Any]:
    """One RL step (FP8 rollouts, KL reference on, no dynamic sampling) with scoring and update counted."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"problem": "Compute 7 + 5.", "answer": "12"}) + "\n")
    cfg = one_step_config(tmp_path, prompts, name, GROUP, RESPONSE, kl_coef=0.1, optim={"lr": 1e-3})
    score, update = rl_loop.score, rl_loop.update

    def counted(fn):
        def run(*args):
            with blocks:
                return fn(*args)

        return run

    monkeypatch.setattr(rl_loop, "score", counted(score))
    monkeypatch.setattr(rl_loop, "update", counted(update))
    model = make_tiny_model(vocab_size=VOCAB, hidden=HIDDEN, layers=1, seed=1)
    return rl(cfg, model=model, tokenizer=tok, progress=False).history[0]


def test_an_rl_step_allocates_no_vocabulary_block_beyond_the_chunk(tmp_path, tiny_tokenizer, monkeypatch):
    """With the budget at 8 tokens' fp32 logits, the largest ``[*, V]`` block scoring and update allocate
    (old, reference and policy log-probabilities, entropy, backward) is 8 rows: 1/12 of the micro-batch's
    ``[B, R, V]``; the same step unchunked allocates the whole block, and the step's numbers agree."""
    plain_blocks = VocabBlocks(VOCAB, HIDDEN)
    plain = _step(tmp_path, "plain", tiny_tokenizer, plain_blocks, monkeypatch)
    tokens = plain["response_tokens"]
    assert tokens > 8 * GROUP  # responses long enough that a chunk is a small part of them
    assert plain_blocks.rows >= tokens  # the unchunked scoring's logits: every response token's row

    monkeypatch.setattr(scorer, "AUTO_CHUNK_BYTES", 8 * VOCAB * 4)
    chunked_blocks = VocabBlocks(VOCAB, HIDDEN)
    chunked = _step(tmp_path, "chunked", tiny_tokenizer, chunked_blocks, monkeypatch)
    assert chunked["response_tokens"] == tokens  # the same rollout (the same seed, weights, engine)
    assert chunked_blocks.rows == 8 and chunked_blocks.bytes == 8 * VOCAB * 4
    assert plain_blocks.bytes >= tokens * VOCAB * 4 >= 12 * chunked_blocks.bytes
    for key in ("loss", "grad_norm", "entropy", "kl_ref", "mismatch/abs_dlogp_mean", "mismatch/prob_error"):
        assert chunked[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key


CONFIG_DIR = Path(infir2.__file__).parent / "configs"
# an RL config has "rl" among the dash-separated words of its name (qwen2.5-7b-rl, qwen2.5-7b-rl-32k-cp)
RL_CONFIGS = sorted(p for p in CONFIG_DIR.glob("*.yaml") if "rl" in p.stem.split("-"))


def test_every_shipped_config_loads_in_its_schema(tmp_path):
    """The RL configs load as RL configs (and round-trip); every other shipped config loads as a run
    config (``test_train_config`` round-trips those): no shipped file is left unread."""
    assert RL_CONFIGS, "no shipped RL config"
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        if path in RL_CONFIGS:
            cfg = load_rl_config(path)
            save_rl_config(cfg, tmp_path / f"{path.stem}.yaml")
            assert load_rl_config(tmp_path / f"{path.stem}.yaml") == cfg, path.name
        else:
            assert isinstance(load_config(path), RunConfig), path.name


@pytest.mark.parametrize("path", RL_CONFIGS, ids=lambda p: p.stem)
def test_plan_runs_on_the_shipped_rl_configs(path, capsys):
    """``infir2 plan MODEL --rl CONFIG`` prints where the step's memory goes and whether it fits."""
    model = "qwen2.5-7b" if "7b" in path.stem else "qwen2.5-1.5b"
    assert main(["plan", model, "--rl", path.stem, "--gpus", "8", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    for row in (
        "rollout kv cache",
        "rollout engine",
        "reference",
        "scoring",
        "update activations",
        "peak",
    ):
        assert row in out, row
    assert "fit" in out.splitlines()[-1]


def test_plan_says_plainly_when_an_rl_step_does_not_fit(capsys):
    assert main(["plan", "qwen2.5-7b", "--rl", "qwen2.5-7b-rl", "--gpus", "1", "--gpu", "l40s"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("does not fit a L40S")


def _rl_cfg(rollout: str, kl: float, **rollout_keys: int):
    return parse_rl_config(
        {
            "data": {"prompts_path": "p.jsonl"},
            "fp8": {"recipe": "blockwise"},
            "rollout": {"precision": rollout, "group_size": 2, **rollout_keys},
            "algo": {"kl_coef": kl, "micro_batch_size": 2},
        },
        "test",
    )


@pytest.mark.parametrize("rollout", ["fp8", "high"])
def test_rl_plan_terms_match_the_tensors(rollout: str, tiny_tokenizer) -> None:
    """The engine's copy, the reference and the rollout's KV cache, planned on a tiny model's shape, are
    within 10% of the bytes of the real engine's weights, a deep copy, and a DynamicCache filled by a
    prefill of ``batch_size`` x (prompt + max_new_tokens) tokens (CPU: fp32)."""
    from transformers import DynamicCache

    from infir2.generation import BuiltinEngine
    from infir2.generation.sampler import cache_keyword
    from infir2.model import prepare_for_training

    model = make_tiny_model(hidden=256, layers=2)
    shape = ModelShape.from_config(model.config.to_dict(), "<tiny>")
    prompt, new, batch = 32, 96, 3
    cfg = _rl_cfg(rollout, 0.1, max_new_tokens=new, batch_size=batch)
    p = plan_rl(shape, plan_inputs(cfg), gpus=1, prompt_len=prompt, device="cpu")
    policy = prepare_for_training(model, "blockwise")
    engine = BuiltinEngine(policy, tiny_tokenizer, precision=rollout, copy_model=True)
    held = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in engine.model.state_dict().values()
    }
    _within(p.engine, sum(held.values()))
    _within(p.reference, sum(t.numel() * t.element_size() for t in model.parameters()))
    cache = DynamicCache()
    with torch.no_grad():
        ids = torch.randint(0, 300, (batch, prompt + new))
        model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache})  # `cache` from 5.2x
    kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    _within(p.kv_cache * shape.layers / (shape.layers + 1), kv)  # less the growing layer's second copy
    assert plan_rl(shape, plan_inputs(_rl_cfg(rollout, 0.0)), prompt_len=prompt, device="cpu").reference == 0


def _within(planned: float, measured: float, tol: float = 0.10) -> None:
    assert abs(planned / measured - 1) <= tol, (planned, measured)
