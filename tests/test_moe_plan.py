"""infir2 plan on a mixture of experts: total and active parameters exact, saved bytes near a whole model's."""

from __future__ import annotations

import json

import pytest
import torch

from infir2.cli import main
from infir2.nn import convert_to_fp8, recompute_swiglu
from infir2.tools.plan import plan
from moe_models import make_tiny_moe
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
