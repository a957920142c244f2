"""optim.grad_dtype: bf16 -- gradients kept in bf16 per parameter as autograd hands them over
(``infir2.harness.grads``): the values against a hand computation, the bytes, the update against fp32
gradients, the planner's term, and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import make_tiny_model
from infir2.harness.grads import GRAD_ATTR, drop_grads, grad_of, keep_bf16_grads
from infir2.harness.guards import clip_grad_norm, grad_norm
from infir2.harness.optim import build_optimizer
from infir2.loss import lm_loss_sum
from infir2.planning import ModelShape, plan
from infir2.train.config import parse_config
from train_synthetic import one_thread

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 8))


def _backward(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
    nn.functional.mse_loss(model(x), y).backward()


def test_bf16_gradients_are_the_fp32_sum_rounded_once_per_micro_batch() -> None:
    ref, kept = _model(), _model()
    keep_bf16_grads(kept)
    for model in (ref, kept):
        _backward(model, 0)
    first = {n: p.grad.clone() for n, p in ref.named_parameters()}
    for (name, _), q in zip(ref.named_parameters(), kept.parameters(), strict=True):
        assert q.grad is None  # freed as soon as autograd handed it over
        assert getattr(q, GRAD_ATTR).dtype == torch.bfloat16
        assert torch.equal(grad_of(q), first[name].to(torch.bfloat16))
    ref.zero_grad(set_to_none=True)
    for model in (ref, kept):  # a second micro-batch: bf16(bf16(g1) + g2), the sum in fp32
        _backward(model, 1)
    for (name, p), q in zip(ref.named_parameters(), kept.parameters(), strict=True):
        expected = (first[name].to(torch.bfloat16).float() + p.grad).to(torch.bfloat16)
        assert torch.equal(grad_of(q), expected), name
    drop_grads(kept.parameters())
    assert all(grad_of(q) is None for q in kept.parameters())


def test_norm_clip_and_update_read_the_bf16_gradients() -> None:
    cfg = parse_config({"optim": {"grad_dtype": "bf16", "lr": 1e-2}}, "<test>").optim
    model = _model()
    opt = build_optimizer(model, cfg)
    _backward(model, 0)
    grads = [grad_of(p).double() for p in model.parameters()]
    assert grad_norm(model) == pytest.approx(float(torch.cat([g.flatten() for g in grads]).norm()), rel=1e-12)
    norm = clip_grad_norm(model, 0.01)
    assert grad_norm(model) == pytest.approx(0.01, rel=1e-2) and norm > 0.01
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    opt.zero_grad(set_to_none=True)
    assert all(grad_of(p) is None for p in model.parameters())


@pytest.mark.parametrize("state_dtype", ["fp32", "fp8"])
def test_bf16_gradients_track_fp32_gradients(state_dtype: str) -> None:
    """20 steps: the weights' distance from fp32 gradients' run is a few percent of how far they moved
    (bound 5%; bf16 rounding of a gradient is 2**-9 relative), and not zero."""
    runs = []
    for grad_dtype in ("fp32", "bf16"):
        cfg = parse_config(
            {"optim": {"grad_dtype": grad_dtype, "state_dtype": state_dtype, "lr": 1e-2}}, "<t>"
        )
        model = _model()
        opt = build_optimizer(model, cfg.optim)
        for step in range(20):
            _backward(model, step)
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append(model)
    for p0, pa, pb in zip(_model().parameters(), runs[0].parameters(), runs[1].parameters(), strict=True):
        assert 0 < (pa - pb).norm() < 0.05 * (pa - p0).norm()


def test_the_plan_counts_the_bf16_gradients() -> None:
    """The planner's gradient term (2 bytes per parameter, the largest parameter's fp32 gradient in place
    of its bf16 copy while it is handed over) against the tensors after a tiny model's backward."""
    model = make_tiny_model(hidden=128)
    keep_bf16_grads(model)
    ids = torch.randint(0, 300, (2, 64))
    lm_loss_sum(model, ids, ids, chunk_tokens=None).backward()
    kept = sum(grad_of(p).numel() * grad_of(p).element_size() for p in model.parameters())
    shape = ModelShape.from_config(model.config.to_dict(), "<tiny>")
    largest = max(p.numel() for p in model.parameters())
    planned = plan(shape, "bf16", gpus=1, seq_len=64, micro_batch=2, grad_dtype="bf16").gradients
    assert planned == kept - 2 * largest + 4 * largest


def test_bf16_gradients_are_refused_where_they_cannot_be() -> None:
    with pytest.raises(ValueError, match=r"optim\.grad_dtype"):
        parse_config({"optim": {"grad_dtype": "fp16"}}, "<test>")
    with pytest.raises(ValueError, match=r"optim\.grad_dtype"):
        plan(ModelShape(128, 256, 2, 4, 2, 300, True), "bf16", gpus=2, grad_dtype="bf16")
    from infir2.train.setup import check_inputs
    from train_synthetic import tiny_run_config

    cfg = tiny_run_config("/nonexistent", optim={"grad_dtype": "bf16"})
    check_inputs(cfg, world_size=1, data=False)  # one process: fine
    with pytest.raises(ValueError, match=r"optim\.grad_dtype: bf16 .* one process only, this run has 2"):
        check_inputs(cfg, world_size=2, data=False)  # before any folder, model or data
