"""``plan --rl`` with the RL config's context degree (``parallel.context``, issue 41): the update and the
scoring hold a 1/N share of each sequence plus the keys and values gathered from the other shards; the
rollout's KV cache, the engine and the reference stay whole; FSDP still shards over every GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from infir2.planning import ModelShape, PlanInputs, RLInputs, context_kv_bytes, plan_rl
from infir2.rl.config import parse_rl_config
from infir2.rl.plan_inputs import plan_inputs
from train_synthetic import one_thread

_one_thread = pytest.fixture(autouse=True)(one_thread)

SHAPE = ModelShape(256, 512, 4, 4, 2, 1000, False)
PROMPT, NEW, MICRO = 128, 896, 2  # sequences of 1024 tokens: every share whole


def _cfg(context: int, checkpointing: bool = False) -> RLInputs:
    """The planner's record of an RLConfig with ``parallel.context`` set."""
    cfg = parse_rl_config(
        {
            "model": {"path": "unused", "precision": "bf16", "activation_checkpointing": checkpointing},
            "fp8": {"recipe": "blockwise"},
            "data": {"prompts_path": "unused.jsonl"},
            "rollout": {"max_new_tokens": NEW},
            "algo": {"micro_batch_size": MICRO, "kl_coef": 0.01},
        }
    )
    return replace(plan_inputs(cfg), context=context)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_context_4_splits_the_update_and_the_scoring_not_the_rollout(checkpointing: bool) -> None:
    one = plan_rl(SHAPE, _cfg(1, checkpointing), gpus=8, prompt_len=PROMPT)
    four = plan_rl(SHAPE, _cfg(4, checkpointing), gpus=8, prompt_len=PROMPT)
    assert (four.kv_cache, four.engine, four.reference, four.rollout_logits) == (
        one.kv_cache,
        one.engine,
        one.reference,
        one.rollout_logits,
    )
    assert four.reference > 0 and four.kv_cache > 0  # the whole copies are there, and not split
    u1, u4 = one.update, four.update
    assert (u4.parameters, u4.optimizer, u4.gathered) == (u1.parameters, u1.optimizer, u1.gathered)
    gathered = context_kv_bytes(SHAPE, MICRO * (PROMPT + NEW), 4, cpu=False)  # 3/4 of each layer's K, V
    assert gathered == 2 * SHAPE.kv_heads * SHAPE.head_dim * 2 * MICRO * (PROMPT + NEW) * 3 / 4
    layers = 1 if checkpointing else SHAPE.layers
    assert u4.activations - layers * gathered == pytest.approx(u1.activations / 4, rel=1e-12)
    assert u4.logits_saved == u1.logits_saved / 4
    hidden = MICRO * (PROMPT + NEW) * SHAPE.hidden * 4
    block_1, block_4 = one.scoring - hidden, four.scoring - hidden / 4 - gathered
    assert 0 < block_4 <= block_1  # two [chunk, V] blocks of a quarter of the responses
    assert four.update_peak < one.update_peak and four.scoring_peak < one.scoring_peak
    assert four.rollout_peak == one.rollout_peak


def test_the_record_reads_the_configs_context() -> None:
    cfg = parse_rl_config({"data": {"prompts_path": "unused.jsonl"}, "parallel": {"context": 2}})
    assert plan_inputs(cfg).context == 2 and plan_inputs(_replace_context(cfg, 1)).context == 1


def test_the_update_is_planned_with_the_configs_training_settings() -> None:
    """``RLInputs.update`` takes the fields it shares with ``PlanInputs`` by name: the record equals one
    written out field by field from the config (model.precision fp64 planned as fp32)."""
    cfg = parse_rl_config(
        {
            "model": {"path": "unused", "precision": "fp64", "activation_checkpointing": True},
            "fp8": {"recipe": "blockwise"},
            "optim": {"state_dtype": "fp8", "fp8_block": 32, "fp8_range_expansion": True},
            "data": {"prompts_path": "unused.jsonl"},
            "algo": {"micro_batch_size": 3},
            "parallel": {"context": 2},
        }
    )
    m, o = cfg.model, cfg.optim
    expected = PlanInputs(
        "blockwise",
        gpus=4,
        seq_len=640,
        micro_batch=3,
        activation_checkpointing=True,
        state_dtype="fp8",
        state_block=32,
        state_expand=True,
        grad_dtype=o.grad_dtype,
        recompute_mlp=m.recompute_mlp,
        precision="fp32",
        device="cpu",
        context=2,
    )
    assert plan_inputs(cfg).update(4, 640, "cpu") == expected


def test_gpus_that_the_context_does_not_divide_are_refused() -> None:
    with pytest.raises(ValueError, match="divide gpus=6"):
        plan_rl(SHAPE, _cfg(4), gpus=6, prompt_len=PROMPT)


def test_the_shipped_long_trace_config_is_planned_with_its_context_degree(capsys) -> None:
    """``qwen2.5-7b-rl-32k-cp`` (32k responses, context 4) fits an H100 at 8 GPUs; the same config at
    context 1 keeps four times the update's activations per GPU."""
    from infir2.cli import main
    from infir2.planning import MODELS, load_shape
    from infir2.rl.config import load_rl_config

    cfg = load_rl_config("qwen2.5-7b-rl-32k-cp")
    assert cfg.parallel.context == 4 and cfg.rollout.max_new_tokens == 32768
    _, shape = load_shape("qwen2.5-7b")
    four = plan_rl(shape, plan_inputs(cfg), gpus=8, prompt_len=512)
    whole = plan_rl(shape, plan_inputs(_replace_context(cfg, 1)), gpus=8, prompt_len=512)
    assert whole.update.activations == pytest.approx(4 * four.update.activations, rel=0.02)
    assert four.kv_cache == whole.kv_cache  # the rollout is not split
    assert "qwen2.5-7b" in MODELS
    assert main(["plan", "qwen2.5-7b", "--rl", "qwen2.5-7b-rl-32k-cp", "--gpus", "8", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "context 4" in out and "fits a H100" in out


def _replace_context(cfg, context: int):
    return replace(cfg, parallel=replace(cfg.parallel, context=context))
