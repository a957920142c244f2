"""infir2 plan on a mixture of experts: total and active parameters exact, saved bytes near a whole model's."""

from __future__ import annotations

import json

import pytest
import torch

from infir2.cli import main
from infir2.nn import convert_to_fp8, recompute_rmsnorm, recompute_swiglu
from infir2.planning import MODELS, load_shape, plan
from moe_models import make_tiny_moe, moe_config, qwen3_30b_a3b_config
from test_plan import BATCH, SEQ, _shape, saved_bytes
from train_synthetic import one_thread

_one_thread = pytest.fixture(autouse=True)(one_thread)


def test_qwen2_moe_parameters_total_and_active():
    model = make_tiny_moe("qwen2_moe")
    shape = _shape(model)
    assert (shape.experts, shape.top_k, shape.expert_intermediate, shape.shared_intermediate) == (
        4,
        2,
        128,
        128,
    )
    assert shape.params == sum(p.numel() for p in model.parameters())
    idle_experts = 2 * 2 * 3 * 128 * 128  # layers x idle experts x (gate, up, down) x H x I
    assert shape.active_params == shape.params - idle_experts


@pytest.mark.parametrize("recipe", ["bf16", "blockwise"])
def test_saved_bytes_near_a_whole_tiny_moe_model(recipe):
    """Activations + logits + weight copies of the plan: a lower bound of what the model's forward keeps,
    within 35% (an MoE layer is estimated from the dense layer of its active width; the experts' own
    gating and combine, the router and transformers' fp32 expert GEMMs under autocast keep more)."""
    model = make_tiny_moe("qwen2_moe")
    recompute_swiglu(model)
    recompute_rmsnorm(model)
    if recipe != "bf16":
        convert_to_fp8(model, recipe)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    measured = saved_bytes(model, ids)
    p = plan(_shape(model), recipe, gpus=1, seq_len=SEQ, micro_batch=BATCH, loss_chunk_tokens=0)
    planned = p.activations + p.logits_saved + p.weight_copies
    assert 0.65 * measured <= planned <= measured, (planned, measured)


def test_cli_names_active_parameters(tmp_path, capsys):
    config = make_tiny_moe("mixtral").config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config, default=str))
    assert main(["plan", str(tmp_path), "--gpus", "2", "--seq-len", "256"]) == 0
    assert "active: 2 of 4 experts per layer" in capsys.readouterr().out


def test_qwen3_moe_with_its_own_head_dim_parameters_total_and_active():
    """Qwen3-MoE's heads are wider than hidden / heads (as in Qwen3-30B-A3B: 32 x 128 over 2048); q_norm
    and k_norm per head, no q / k / v biases: the plan counts the model's parameters exactly."""
    from transformers import AutoModelForCausalLM

    config = moe_config("qwen3_moe")
    config.head_dim = 96  # 2 heads of 96 over hidden 128
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert model.model.layers[0].self_attn.q_proj.out_features == 2 * 96
    shape = _shape(model)
    assert shape.params == sum(p.numel() for p in model.parameters())
    idle_experts = 2 * 2 * 3 * 128 * 128  # layers x idle experts x (gate, up, down) x H x I
    assert shape.active_params == shape.params - idle_experts


def test_qwen3_30b_a3b_is_shipped_with_its_published_size(capsys):
    """``infir2 plan qwen3-30b-a3b``: the parameters of the model transformers builds from the shipped
    fields (on the meta device, no memory), ~30.5B total and ~3.3B active as Qwen publishes."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen3_30b_a3b_config())
    name, shape = load_shape("Qwen3-30B-A3B")
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert 30.4e9 < shape.params < 30.6e9 and 3.3e9 < shape.active_params < 3.4e9
    # the embedded figures of its layer (the dense layer of the active width, 8 x 768, heads of 128)
    from infir2.planning import MEASURED, ModelShape

    row = MEASURED[(2048, 8 * 768, 32, 4, True, True, False, 128)]
    dense = ModelShape(2048, 8 * 768, 48, 32, 4, 151936, False, head_dim=128).projection_weights
    assert row["bf16"][1] == 2 * dense and dense < row["blockwise"][1] < 1.001 * dense
    assert main(["plan", name, "--gpus", "8", "--seq-len", "8192", "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "30.53B parameters (3.35B active: 8 of 128 experts per layer)" in out and "fits a H100" in out


def test_what_the_plan_does_not_model_is_said(tmp_path, caplog):
    """DeepSeek-V3's latent attention and first dense layers: a warning each, the plan still made;
    Qwen3-30B-A3B's config (plain attention, every layer MoE) warns about nothing."""
    import logging

    from infir2.planning import unmodelled

    config = moe_config("deepseek_v3").to_dict() | {"first_k_dense_replace": 1}
    (tmp_path / "config.json").write_text(json.dumps(config, default=str))
    with caplog.at_level(logging.WARNING, logger="infir2.planning.shape"):
        _, shape = load_shape(str(tmp_path))
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "latent attention (MLA" in said and "planned as MoE layers" in said and shape.experts == 4
    assert unmodelled(qwen3_30b_a3b_config().to_dict()) == [] and unmodelled(MODELS["qwen2.5-7b"]) == []
