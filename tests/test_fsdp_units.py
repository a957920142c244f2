"""FSDP2's units (``harness.distributed.shard_model``): every decoder layer, an untied input embedding on its
own (resharded after its forward, as torchtitan shards it), the root last; and the planner counts it so."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from conftest import make_tiny_model
from infir2.harness.distributed import shard_model, untied_input_embedding
from infir2.model import prepare_for_training
from infir2.planning import PlanInputs, load_shape, plan_step


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("recipe", [None, "blockwise"])
@pytest.mark.parametrize("tie", [False, True])
def test_an_untied_embedding_is_a_unit_of_its_own(one_rank_group, tie, recipe) -> None:
    """As training shards it: after ``prepare_for_training`` (FP8 projections, the recomputes) too, a
    tied embedding stays lm_head's weight in the root."""
    model = make_tiny_model(tie=tie)
    if recipe is not None:
        model = prepare_for_training(model, recipe)
    embedding = model.get_input_embeddings()
    assert (untied_input_embedding(model) is embedding) is not tie
    shard_model(model, "fp32", fp8_param_gather=recipe is not None)
    assert isinstance(embedding, FSDPModule) is not tie
    assert all(isinstance(layer, FSDPModule) for layer in model.model.layers) and isinstance(
        model, FSDPModule
    )
    assert not isinstance(model.get_output_embeddings(), FSDPModule)  # lm_head stays in the root
    ids = torch.randint(0, 300, (2, 16))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(p.grad is not None for p in model.parameters())


def test_the_plan_gathers_an_untied_embedding_only_in_its_passes() -> None:
    """At the start of backward the root holds lm_head and the final norm, gathered, and their gradients: an
    untied model holds as much there as a tied one (whose embedding is lm_head's weight), not one [V, H]
    matrix more; each step gathers the untied embedding twice (its forward and its backward) and lm_head once,
    the tied model its one matrix once."""
    _, shape = load_shape("qwen2.5-7b")
    run = PlanInputs("blockwise", gpus=8, seq_len=8192, activation_checkpointing=True)
    untied, tied = plan_step(shape, run), plan_step(replace(shape, tied=True), run)
    assert untied.gathered == tied.gathered
    matrix = shape.vocab * shape.hidden * 2 * (1 - 1 / 8)  # one [V, H] in bf16, the 7/8 other ranks hold
    assert untied.all_gather - tied.all_gather == pytest.approx(2 * matrix, rel=1e-12)
