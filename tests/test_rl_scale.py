"""RL at the size it ships for, checked small: one RL step allocates no full-vocabulary block beyond the
scorer's chunk (bytes counted per allocation, not time), and the chunked step's numbers equal the
unchunked step's."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import infir2.loss.scorer as scorer
from conftest import make_tiny_model
from infir2.rl import loop as rl_loop
from infir2.rl import parse_rl_config, rl
from train_synthetic import one_thread

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
    cfg = parse_rl_config(
        {
            "run": {"name": name, "out_dir": str(tmp_path), "device": "cpu"},
            "model": {"precision": "fp32"},
            "fp8": {"recipe": "blockwise"},
            "optim": {"lr": 1e-3},
            "data": {"prompts_path": str(prompts)},
            "rollout": {
                "precision": "fp8",
                "prompts_per_step": 1,
                "group_size": GROUP,
                "oversample_prompts": 1,
                "max_new_tokens": RESPONSE,
                "batch_size": GROUP,
            },
            "algo": {"dynamic_sampling": False, "kl_coef": 0.1, "micro_batch_size": GROUP},
            "train": {"max_steps": 1, "save_every": 0},
        },
        "test",
    )
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
