"""The recomputing SwiGLU MLP: bit-identical values and gradients, and fewer bytes kept for backward."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_tiny_model
from infir2 import convert_to_fp8
from infir2.nn import recompute_swiglu


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("recipe", ["bf16", "blockwise"])
def test_whole_model_gradients_are_bit_identical(arch, recipe):
    plain = make_tiny_model(arch, hidden=160)
    if recipe != "bf16":
        convert_to_fp8(plain, recipe)
    recomputing = copy.deepcopy(plain)
    assert recompute_swiglu(recomputing) == 2  # one MLP per layer
    assert recompute_swiglu(recomputing) == 0  # idempotent
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    loss_a, grads_a = _loss_and_grads(plain, ids)
    loss_b, grads_b = _loss_and_grads(recomputing, ids)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_bf16_autocast_gradients_are_bit_identical():
    plain = make_tiny_model("qwen2", hidden=64, layers=1)
    recomputing = copy.deepcopy(plain)
    recompute_swiglu(recomputing)
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_a, grads_a = _loss_and_grads(plain, ids)
        loss_b, grads_b = _loss_and_grads(recomputing, ids)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def _saved_bytes(fn) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("recipe", ["bf16", "blockwise"])
def test_silu_output_is_no_longer_kept(recipe):
    model = make_tiny_model("qwen2", hidden=128, layers=1)
    if recipe != "bf16":
        convert_to_fp8(model, recipe)
    mlp = model.model.layers[0].mlp
    x = torch.randn(64, 128, requires_grad=True)
    before = _saved_bytes(lambda: mlp(x))
    recompute_swiglu(model)
    after = _saved_bytes(lambda: mlp(x))
    tokens, inter = 64, mlp.gate_proj.out_features
    assert before - after == tokens * inter * 4  # exactly one fp32 [T, I] tensor: silu(g)
