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


def saved_storages(fn) -> dict[int, int]:
    """The storages autograd saves while ``fn`` runs: {data pointer: bytes}."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


def _saved_bytes(fn) -> int:
    return sum(saved_storages(fn).values())


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


# ---------------------------------------------------------------- fp8_saved (model.mlp_saved_fp8), lossy


def _round_trip(t: torch.Tensor) -> torch.Tensor:
    """``t`` through E4M3 with one scale per 1x128 tile, as ``fp8_saved`` keeps it (``infir2.fp8.quantize``)."""
    from infir2.fp8.quantize import dequantize, quantize
    from infir2.nn.swiglu import SAVED_TILE

    flat = t.detach().reshape(-1, t.shape[-1])
    return dequantize(*quantize(flat, SAVED_TILE), SAVED_TILE, t.dtype).view(t.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_saved_is_the_exact_backward_of_the_decoded_inputs(dtype):
    """The forward is the plain one's, bit for bit; the gradients are exactly those of the exact recompute
    at the FP8-decoded gate and up outputs (a second computation of the same rule), and within FP8's
    floor (25 dB SQNR) of the fp64 gradients of the unquantized ones."""
    from infir2 import sqnr
    from infir2.nn.swiglu import swiglu

    gen = torch.Generator().manual_seed(0)
    g0, u0 = (torch.randn(2, 48, 320, generator=gen).to(dtype) for _ in range(2))
    g0[0, 3] *= 40  # an outlier token: its own scales
    dh = torch.randn(2, 48, 320, generator=gen).to(dtype)
    g, u = g0.clone().requires_grad_(), u0.clone().requires_grad_()
    h = swiglu(g, u, fp8_saved=True)
    h.backward(dh)
    assert torch.equal(h, torch.nn.functional.silu(g0) * u0)
    gq, uq = _round_trip(g0).requires_grad_(), _round_trip(u0).requires_grad_()
    swiglu(gq, uq).backward(dh)
    assert torch.equal(g.grad, gq.grad) and torch.equal(u.grad, uq.grad)
    g64, u64 = g0.double().requires_grad_(), u0.double().requires_grad_()
    (torch.nn.functional.silu(g64) * u64).backward(dh.double())
    assert sqnr(g64.grad, g.grad.double()) >= 25 and sqnr(u64.grad, u.grad.double()) >= 25


def test_fp8_saved_keeps_one_byte_per_element_and_a_scale_per_tile():
    """Per saved tensor: the bf16 gate and up outputs (2 bytes per element each) become E4M3 codes [T, I]
    and fp32 scales [T, I / 128]."""
    from infir2.nn.swiglu import swiglu

    tokens, inter = 64, 384
    g, u = (torch.randn(tokens, inter, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    seen: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def pack(t):
        seen.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        swiglu(g, u)
    assert seen == [(torch.bfloat16, (tokens, inter))] * 2
    seen.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        swiglu(g, u, fp8_saved=True)
    codes, scales = (torch.float8_e4m3fn, (tokens, inter)), (torch.float32, (tokens, inter // 128))
    assert seen == [codes, scales, codes, scales]


def test_fp8_saved_needs_the_recompute():
    from infir2.model import prepare_for_training
    from infir2.train.config import parse_config

    assert parse_config({}, "<t>").model.mlp_saved_fp8 is False
    with pytest.raises(ValueError, match=r"run\.yaml: model\.mlp_saved_fp8: .*needs model\.recompute_mlp"):
        parse_config({"model": {"mlp_saved_fp8": True, "recompute_mlp": False}}, "run.yaml")
    with pytest.raises(ValueError, match="needs recompute_mlp"):
        prepare_for_training(
            make_tiny_model(hidden=64, layers=1), "bf16", recompute_mlp=False, mlp_saved_fp8=True
        )
    model = prepare_for_training(make_tiny_model(hidden=64, layers=1), "blockwise", mlp_saved_fp8=True)
    assert recompute_swiglu(model, fp8_saved=True) == 0  # already so
    assert recompute_swiglu(model) == 1  # back to the exact one


def _short_run(recipe: str, fp8_saved: bool) -> torch.Tensor:
    """Twenty AdamW steps of a tiny model on one batch: the loss at each step."""
    model = make_tiny_model("qwen2", hidden=128, layers=2, seed=3)
    recompute_swiglu(model, fp8_saved=fp8_saved)
    if recipe != "bf16":
        convert_to_fp8(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 300, (4, 64), generator=torch.Generator().manual_seed(4))
    curve = []
    for _ in range(20):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        curve.append(loss.item())
    return torch.tensor(curve)


def test_fp8_saved_tracks_the_exact_recompute_over_a_short_run():
    """FP8 blockwise, with the SwiGLU's inputs kept in FP8 or not, and bf16 (no FP8 at all): the loss
    curve with them in FP8 stays closer to the exact one than FP8's GEMMs themselves stay to bf16, and
    within 2% at every step (measured: 1.2% at most, 0.7% on average; FP8 GEMMs against bf16: 2.5%)."""
    exact, fp8_saved, bf16 = (
        _short_run("blockwise", False),
        _short_run("blockwise", True),
        _short_run("bf16", False),
    )
    assert fp8_saved[-1] < 0.2 * fp8_saved[0]  # it trains
    assert not torch.equal(exact, fp8_saved)  # lossy: the gradients differ

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs() / b).max().item()

    assert gap(fp8_saved, exact) < min(gap(bf16, exact), 0.02), (exact, fp8_saved, bf16)
