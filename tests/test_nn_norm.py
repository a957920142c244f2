"""The recomputing RMSNorm: bit-identical values and gradients, and one [T, H] fp32 tensor fewer kept."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_tiny_model
from infir2 import convert_to_fp8
from infir2.nn import recompute_rmsnorm, recompute_swiglu
from test_nn_swiglu import saved_storages
from train_synthetic import one_thread

pytestmark = pytest.mark.transformers_api  # transformers' RMSNorm classes, patched by name

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _loss_and_grads(model, ids, autocast: bool = False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_bit_identical(plain, recomputing, ids, autocast: bool = False) -> None:
    loss_a, grads_a = _loss_and_grads(plain, ids, autocast)
    loss_b, grads_b = _loss_and_grads(recomputing, ids, autocast)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize(
    ("arch", "recipe", "norms"),
    [("qwen2", "bf16", 5), ("llama", "blockwise", 5), ("qwen2", "blockwise", 5), ("qwen3", "blockwise", 9)],
)
def test_whole_model_gradients_are_bit_identical(arch, recipe, norms):
    """Two layers (two norms each, Qwen3's q/k norms besides) and the final norm, fp32, with and
    without FP8 and the SwiGLU recompute beside it."""
    plain = make_tiny_model(arch, hidden=160)
    recompute_swiglu(plain)
    if recipe != "bf16":
        convert_to_fp8(plain, recipe)
    recomputing = copy.deepcopy(plain)
    assert recompute_rmsnorm(recomputing) == norms
    assert recompute_rmsnorm(recomputing) == 0  # idempotent
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    _assert_bit_identical(plain, recomputing, ids)


def test_bf16_autocast_gradients_are_bit_identical():
    """As a GPU run trains: fp32 masters and residual stream, the projections in bf16."""
    plain = make_tiny_model("qwen2", hidden=64, layers=2)
    convert_to_fp8(plain, "blockwise")
    recomputing = copy.deepcopy(plain)
    recompute_rmsnorm(recomputing)
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    _assert_bit_identical(plain, recomputing, ids, autocast=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_and_their_casts_are_bit_identical(dtype):
    """fp64 (the norm computes in fp32 and casts back: two casts in the graph) and bf16 weights and
    activations (fp32 inside, bf16 out)."""
    plain = make_tiny_model("llama", hidden=64, layers=2).to(dtype)
    recomputing = copy.deepcopy(plain)
    recompute_rmsnorm(recomputing)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(2))
    _assert_bit_identical(plain, recomputing, ids)


def test_mixed_dtypes_and_a_frozen_weight_match_autograd():
    """An fp32 weight over bf16 input (the output promotes to fp32, the cast back to bf16 sits between
    the two Mul nodes) and a frozen weight: the same bits as the plain norm's autograd."""
    model = make_tiny_model("qwen2", hidden=64, layers=1)
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    dy = torch.randn(3, 5, 64)
    for frozen in (False, True):
        norm.weight.requires_grad_(not frozen)
        results = []
        for recompute in (False, True):
            if recompute:
                recompute_rmsnorm(model)
            xi = x.clone().requires_grad_()
            y = norm(xi)
            y.backward(dy)
            results.append((y.detach(), xi.grad, None if frozen else norm.weight.grad.clone()))
            norm.weight.grad = None
        (y_a, dx_a, dw_a), (y_b, dx_b, dw_b) = results
        assert y_a.dtype == y_b.dtype == torch.float32
        assert torch.equal(y_a, y_b) and torch.equal(dx_a, dx_b)
        assert (dw_a is None and dw_b is None) or torch.equal(dw_a, dw_b)
        model = make_tiny_model("qwen2", hidden=64, layers=1)
        norm = model.model.layers[0].input_layernorm
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)


def test_gradients_match_an_fp64_reference():
    """Independent of autograd's own graph: the closed form of RMSNorm's gradients in fp64."""
    model = make_tiny_model("qwen2", hidden=64, layers=1)
    norm = model.model.layers[0].post_attention_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    recompute_rmsnorm(model)
    x = torch.randn(4, 7, 64, requires_grad=True)
    dy = torch.randn(4, 7, 64)
    norm(x).backward(dy)
    x64, w64, dy64, eps = (
        x.detach().double(),
        norm.weight.detach().double(),
        dy.double(),
        norm.variance_epsilon,
    )
    rstd = (x64.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    h = x64 * rstd
    g = dy64 * w64
    dx = rstd * (g - h * (g * h).mean(-1, keepdim=True))
    dw = (dy64 * h).sum((0, 1))
    torch.testing.assert_close(x.grad.double(), dx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.weight.grad.double(), dw, rtol=1e-5, atol=1e-5)


def test_activation_checkpointing_gradients_are_bit_identical():
    plain = make_tiny_model("qwen2", hidden=64, layers=2)
    convert_to_fp8(plain, "blockwise")
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    recomputing = copy.deepcopy(plain)
    recompute_rmsnorm(recomputing)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    _assert_bit_identical(plain, recomputing, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_normalized_output_is_no_longer_kept(dtype):
    """Per saved tensor: before, x (fp32), rstd [T, 1] and h = x * rstd (in the input's dtype, [T, H]);
    after, x and rstd only (the weight is a parameter either way)."""
    model = make_tiny_model("qwen2", hidden=128, layers=1).to(dtype)
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(64, 128, dtype=dtype, requires_grad=True)
    weight = norm.weight.untyped_storage().data_ptr()
    before = saved_storages(lambda: norm(x))
    recompute_rmsnorm(model)
    after = saved_storages(lambda: norm(x))
    before.pop(weight), after.pop(weight)
    fp32_x, h = 64 * 128 * 4, 64 * 128 * dtype.itemsize
    assert sorted(before.values()) == sorted([64 * 4, fp32_x, h])
    assert sorted(after.values()) == sorted([64 * 4, fp32_x])


def test_the_setting_reaches_the_model_and_a_bad_value_is_refused():
    """``model.recompute_norm`` (default true) is what ``prepare_for_training`` applies; not a bool: one
    line naming the file and the key."""
    from infir2.model import prepare_for_training
    from infir2.nn.norm import _rmsnorm_forward
    from infir2.train.config import parse_config

    assert parse_config({}, "<t>").model.recompute_norm is True
    for on in (True, False):
        model = prepare_for_training(make_tiny_model("qwen2", hidden=64, layers=1), "bf16", recompute_norm=on)
        patched = [getattr(m.forward, "__func__", None) is _rmsnorm_forward for m in model.modules()]
        assert sum(patched) == (3 if on else 0)  # two norms in the layer, the final one
    with pytest.raises(ValueError, match=r"run\.yaml: model\.recompute_norm: expected true or false"):
        parse_config({"model": {"recompute_norm": "yes"}}, "run.yaml")
