"""The exact sampler (``rollout.exact``, ``nn.exact``): the built-in engine's KV-cached decode gives each
token the log-probability of the trainer's full forward bit for bit for the identical pairs, so RL's
mismatch metrics are exactly 0 over 10 updates, on a dense and an MoE tiny model; the attention it runs
is softmax attention (an fp64 reference) whatever the padding and the cache length."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_model
from infir2.eval import GRADERS, Graded
from infir2.generation import BuiltinEngine, RolloutEngine, SamplingConfig, use_exact_numerics
from infir2.model import prepare_for_training
from infir2.nn.exact import exact_attention
from infir2.rl import parse_rl_config, rl
from infir2.rl.batch import RLBatch
from infir2.rl.update import response_logprobs
from moe_models import make_tiny_moe, moe_config
from train_synthetic import one_thread

pytestmark = pytest.mark.transformers_api  # transformers' attention interface, mask helpers and KV cache

_one_thread = pytest.fixture(autouse=True)(one_thread)

PROMPTS = [
    "Compute 7 + 5 - 3.",
    "The quick brown fox",
    "12 + 30 = ",
    "a",
    "hello there my friend how are you",
]


def _mask(pad: torch.Tensor, queries: int) -> torch.Tensor:
    """transformers' 4-D bool mask: causal, keys with ``pad`` (``[B, Lk]``) 0 masked."""
    keys = pad.shape[1]
    causal = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    return causal[None, None] & pad[:, None, None, :].bool()


def _padded(x: torch.Tensor, left: int, right: int = 0) -> torch.Tensor:
    b, h, _, d = x.shape
    return torch.cat([torch.zeros(b, h, left, d), x, torch.zeros(b, h, right, d)], 2)


def test_exact_attention_is_softmax_attention_and_ignores_padding_and_cache_length():
    torch.manual_seed(0)
    b, n = 3, 100  # 100 keys: two key blocks
    q, k, v = torch.randn(b, 4, n, 32), torch.randn(b, 2, n, 32), torch.randn(b, 2, n, 16)
    module = torch.nn.Module()
    left, right = 30, 7  # the trainer's layout: prompt left-padded, response right-padded
    pad = torch.zeros(b, left + n + right)
    pad[:, left : left + n] = 1
    full, _ = exact_attention(module, _padded(q, left, right), _padded(k, left, right), _padded(v, left, right),
                              _mask(pad, left + n + right), scaling=0.2)  # fmt: skip
    # fp64 softmax attention, grouped heads (head h reads kv head h // 2)
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    s = (q.double() @ kk.transpose(-1, -2) * 0.2).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), -torch.inf
    )
    ref = (s.softmax(-1) @ vv).transpose(1, 2)
    assert (full[:, left : left + n].double() - ref).abs().max() < 1e-5
    assert full[:, :left].abs().max() == 0  # a query of padding sees no key: 0, not NaN
    for t in (0, 5, 63, 64, 99):  # one decode step over a cache of t + 1 keys, left padding 0 or 7
        for lp in (0, 7):
            cache = torch.zeros(b, lp + t + 1)
            cache[:, lp:] = 1
            step, _ = exact_attention(module, q[:, :, t : t + 1], _padded(k[:, :, : t + 1], lp),
                                      _padded(v[:, :, : t + 1], lp), _mask(cache, 1), scaling=0.2)  # fmt: skip
            assert torch.equal(step[:, 0], full[:, left + t]), (t, lp)
            first, _ = exact_attention(module, _padded(q[:, :, : t + 1], lp), _padded(k[:, :, : t + 1], lp),
                                       _padded(v[:, :, : t + 1], lp), _mask(cache, lp + t + 1), scaling=0.2)  # fmt: skip
            assert torch.equal(first[:, -1], full[:, left + t]), (t, lp)  # a prompt's forward too


def test_exact_attention_gradients_are_softmax_attentions():
    """The trainer backpropagates through it: its gradients are those of an fp64 softmax attention."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, h, 70, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    pad = torch.ones(2, 70)
    pad[0, :5] = 0  # a left-padded row
    out, _ = exact_attention(torch.nn.Module(), q, k, v, _mask(pad, 70), scaling=0.3)
    keep = pad.bool()[:, :, None, None]  # a padding query's output is 0 by definition
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights * keep).sum(), (q, k, v))
    allowed = _mask(pad, 70)
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3).masked_fill(~allowed, -torch.inf)
    ref = (s.softmax(-1).nan_to_num() @ v.repeat_interleave(2, 1)).transpose(1, 2)
    for got, want in zip(grads, torch.autograd.grad((ref * weights * keep).sum(), (q, k, v)), strict=True):
        assert torch.allclose(got, want, atol=1e-10)


def _engine_vs_trainer(policy, tok, rollout: str, exact: bool, max_new_tokens: int = 70):
    """The engine's per-token log-probabilities and the trainer's (``response_logprobs``) of its tokens."""
    if exact:
        use_exact_numerics(policy)
    builtin = BuiltinEngine(
        policy,
        tok,
        precision=rollout,
        scale_encoding="pow2",
        model_precision="fp32",
        copy_model=True,
        exact=exact,
    )
    engine = RolloutEngine(
        builtin,
        SamplingConfig(greedy=False, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, batch_size=4),
    )  # last batch: 3
    vocab = policy.config.vocab_size
    prompts = [[t % vocab for t in tok(p, add_special_tokens=False)["input_ids"]] for p in PROMPTS]
    groups = engine.generate(prompts, 3, seed=1)
    flat = [(prompts[i], r) for i, g in enumerate(groups) for r in g]
    with torch.no_grad():
        batch = RLBatch.of_responses(
            [p for p, _ in flat], [r.response_ids for _, r in flat], tok.pad_token_id
        )
        logp, _ = response_logprobs(policy, batch.rows(list(range(len(batch)))), 1.0, "fp32")
    train = torch.cat([logp[i, : len(r.logprobs)] for i, (_, r) in enumerate(flat)])
    return torch.cat([torch.tensor(r.logprobs) for _, r in flat]), train


@pytest.mark.parametrize("recipe, rollout", [("blockwise", "fp8"), ("bf16", "high")])
def test_exact_engine_logprobs_are_the_trainers_bit_for_bit(tiny_tokenizer, recipe, rollout):
    roll, train = _engine_vs_trainer(
        prepare_for_training(make_tiny_model(), recipe), tiny_tokenizer, rollout, True
    )
    assert roll.numel() > 500 and torch.equal(roll, train)
    roll, train = _engine_vs_trainer(
        prepare_for_training(make_tiny_model(), recipe), tiny_tokenizer, rollout, False
    )
    assert not torch.equal(roll, train)  # the default decode: the same up to fp32 rounding, not bit for bit
    assert (roll - train).abs().max() < 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_exact_engine_logprobs_of_an_moe_model_are_the_trainers(tiny_tokenizer, family):
    for recipe, rollout in (("blockwise", "fp8"), ("bf16", "high")):
        policy = prepare_for_training(make_tiny_moe(family), recipe)
        roll, train = _engine_vs_trainer(policy, tiny_tokenizer, rollout, True, max_new_tokens=30)
        assert roll.numel() > 200 and torch.equal(roll, train), (family, recipe)


def _config(tmp_path, name: str, precision: str, recipe: str, **rollout) -> dict:
    """A 10-step run of 6 samples a step, each an update (``parse_rl_config`` input)."""
    return {
        "run": {"name": name, "out_dir": str(tmp_path), "device": "cpu"},
        "model": {"precision": "fp32"},
        "fp8": {"recipe": recipe},
        "optim": {"lr": 1e-3},
        "data": {"prompts_path": str(_prompts(tmp_path / "prompts.jsonl"))},
        "rollout": {
            "precision": precision,
            "prompts_per_step": 2,
            "group_size": 3,
            "oversample_prompts": 2,
            "max_new_tokens": 12,
            "batch_size": 6,
            "base_dtype": "fp32",  # the identical pair with blockwise training
            "exact": True,
            **rollout,
        },
        # overlong none: the untrained model's responses are all cut at max_new_tokens, and still trained on
        "algo": {"reward": "parity", "dynamic_sampling": False, "micro_batch_size": 3, "overlong": "none"},
        "train": {"max_steps": 10, "save_every": 0},
    }


def _prompts(path, n=6):
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"problem": f"Compute {i} + {i + 1}.", "answer": str(2 * i + 1)}) + "\n")
    return path


def _moe_of_the_tokenizers_vocabulary(vocab: int) -> torch.nn.Module:
    """The tiny Qwen3-MoE with ``vocab`` embedding rows (RL checks the tokenizer against them)."""
    from transformers import AutoModelForCausalLM

    config = moe_config("qwen3_moe")
    config.vocab_size = vocab
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(config).float()


@pytest.mark.parametrize(
    "model, precision, recipe",
    [("dense", "fp8", "blockwise"), ("dense", "high", "bf16"), ("moe", "fp8", "blockwise")],
)
def test_exact_rl_has_no_mismatch_over_ten_updates(
    tmp_path, tiny_tokenizer, monkeypatch, model, precision, recipe
):
    monkeypatch.setitem(GRADERS, "parity", lambda problem, text: Graded(None, len(text) % 2 == 1))
    policy = make_tiny_model(seed=1) if model == "dense" else _moe_of_the_tokenizers_vocabulary(300)
    cfg = parse_rl_config(_config(tmp_path, "exact", precision, recipe), "test")
    history = rl(cfg, model=policy, tokenizer=tiny_tokenizer, progress=False).history
    assert len(history) == 10 and sum(m["updates"] for m in history) == 10
    assert sum(m["grad_norm"] > 0 for m in history) >= 5  # the policy did change between the steps
    for m in history:
        assert m["mismatch/abs_dlogp_max"] == 0 and m["mismatch/abs_dlogp_mean"] == 0, m["step"]
        assert m["mismatch/k3_kl"] == 0 and m["mismatch/prob_error"] == 1.0, m["step"]


@pytest.mark.parametrize(
    "section, values, says",
    [
        ("model", {"precision": "bf16"}, "needs model.precision: fp32"),
        ("parallel", {"context": 2}, "needs parallel.context: 1"),
        ("rollout", {"engine": "vllm"}, "the built-in engine's decode only"),
        ("algo", {"routing_replay": "rollout"}, "is not wired with algo.routing_replay: rollout"),
    ],
)
def test_exact_is_refused_where_it_is_not_measured(tmp_path, section, values, says):
    data = _config(tmp_path, "bad", "fp8", "blockwise")
    data[section] = {**data.get(section, {}), **values}
    data["algo"]["reward"] = "math"
    with pytest.raises(ValueError, match=r"rollout\.exact") as err:
        parse_rl_config(data, "test")
    assert says in str(err.value)
