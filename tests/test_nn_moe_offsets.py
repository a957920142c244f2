"""The experts' grouped linear over device offsets (``infir2.nn.moe.offsets``) against the per-expert loop.

The loop (``fp8_grouped_linear`` with the counts as Python ints, one quantize and one GEMM per expert)
is the reference: the offsets path must give the same output, input gradient and weight gradient bit
for bit, and save the same FP8 codes for backward, for every recipe it takes, on both CPU emulations,
with uneven groups, an empty expert and groups over several token tiles. A whole MoE model's loss and
gradients are compared with the loop forced. Where it does not run, the loop does.
"""

from __future__ import annotations

import pytest
import torch

from infir2 import convert_to_fp8
from infir2.fp8 import get_recipe
from infir2.kernels import bind
from infir2.nn.moe import experts as experts_module
from infir2.nn.moe import fp8_grouped_linear
from infir2.nn.moe.offsets import TokenTiles, fp8_grouped_linear_offsets, runs_on_offsets
from moe_models import make_tiny_moe

pytestmark = pytest.mark.transformers_api  # the model test builds a transformers MoE

COUNTS = [129, 0, 384, 1, 0, 263]  # uneven, empty experts, a group over several tiles, a lone row
OFFSET_RECIPES = ["blockwise", "blockwise_hybrid", "blockwise_fp32scale", "mxfp8", "fp8_exact"]


def _fp8_saved(fn):  # type: ignore[no-untyped-def]
    """Run ``fn`` and return what it returns and the FP8 tensors autograd saved, as bytes."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            saved.append(t.view(torch.uint8).reshape(-1))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def _run(path, recipe, backend, x, weight, dy):  # type: ignore[no-untyped-def]
    recipe = get_recipe(recipe)
    kernels = bind(recipe, "cpu", backend)
    x, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.no_grad():
        w_ops = [kernels.quantize(w[e].detach(), recipe.w) for e in range(w.shape[0])]
    if path == "loop":
        assert runs_on_offsets(recipe, kernels, x, w)  # the recipe is one the offsets path takes
        y, saved = _fp8_saved(lambda: fp8_grouped_linear(x, w, COUNTS, recipe, kernels, w_ops))
    else:
        counts = torch.tensor(COUNTS)
        y, saved = _fp8_saved(lambda: fp8_grouped_linear_offsets(x, w, counts, recipe, kernels, w_ops))
    y.backward(dy)
    return y.detach(), x.grad, w.grad, torch.cat(saved) if saved else torch.empty(0)


@pytest.mark.parametrize("backend", [None, "emulated"])
@pytest.mark.parametrize("recipe", OFFSET_RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_offsets_equal_the_per_expert_loop_bit_for_bit(recipe, backend, dtype):
    g = torch.Generator().manual_seed(0)
    rows, k, n = sum(COUNTS), 256, 384
    x = (torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, k)).to(dtype)  # outlier channels
    weight = torch.randn(len(COUNTS), n, k, generator=g) * 0.05
    dy = torch.randn(rows, n, generator=g).to(dtype)
    y0, dx0, dw0, saved0 = _run("loop", recipe, backend, x, weight, dy)
    y1, dx1, dw1, saved1 = _run("offsets", recipe, backend, x, weight, dy)
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and torch.equal(dw0, dw1)
    assert saved1.numel() and torch.equal(saved0, saved1)  # the same FP8 codes kept for backward
    assert torch.equal(dw1[1], torch.zeros_like(dw1[1]))  # an expert without rows: zero gradient


def test_token_tiles_start_each_expert_on_a_tile():
    counts = torch.tensor(COUNTS)
    tiles = TokenTiles(counts, 128, sum(COUNTS))
    starts = [0, 256, 256, 640, 768, 768]  # each expert at a multiple of 128 after the last one's tiles
    expected = torch.cat([torch.arange(c) + s for c, s in zip(COUNTS, starts, strict=True)])
    assert torch.equal(tiles.dest, expected) and tiles.size >= 768 + 263
    x = torch.arange(sum(COUNTS), dtype=torch.float32)[:, None] + 1
    padded = tiles.pad(x)
    assert torch.equal(tiles.real(padded), x) and int((padded != 0).sum()) == sum(COUNTS)


@pytest.mark.parametrize(
    ("recipe", "dtype", "backend", "takes"),
    [
        ("blockwise", torch.bfloat16, None, True),
        ("tensorwise", torch.bfloat16, None, False),  # whole-tensor scales: per expert, so the loop
        ("rowwise", torch.bfloat16, None, False),  # column scales over all of an expert's tokens
        ("blockwise", torch.float64, None, False),  # torch._grouped_mm takes no fp64
        ("blockwise", torch.bfloat16, "compiled", False),  # not a plain emulation
    ],
)
def test_where_the_offsets_path_runs(recipe, dtype, backend, takes):
    r = get_recipe(recipe)
    x = torch.zeros(8, 128, dtype=dtype)
    assert runs_on_offsets(r, bind(r, "cpu", backend), x, torch.zeros(2, 128, 128, dtype=dtype)) is takes


@pytest.mark.parametrize("path", ["loop", "offsets"])
def test_autocast_changes_no_bit_of_the_grouped_linear(path):
    """The GEMMs are fp32 sums of dequantized operands with autocast on too (``fp8.accumulate.no_autocast``):
    under bf16 autocast a CPU fp32 matmul runs as a bf16 GEMM, whose result is rounded to bf16 (an fp32
    input shows it on every CPU) and on AVX2 summed in another order (a bf16 input shows it there: the
    whole-model test below failed on AVX2 before the loop turned autocast off, 2026-12-07)."""
    g = torch.Generator().manual_seed(1)
    rows, k, n = sum(COUNTS), 256, 384
    weight = torch.randn(len(COUNTS), n, k, generator=g) * 0.05
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, k)).to(dtype)
        dy = torch.randn(rows, n, generator=g).to(dtype)
        plain = _run(path, "blockwise", None, x, weight, dy)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # backward inside it too
            cast = _run(path, "blockwise", None, x, weight, dy)
        assert cast[0].dtype == dtype
        assert all(torch.equal(a, b) for a, b in zip(plain, cast, strict=True)), dtype


@pytest.mark.parametrize(("recipe", "bf16"), [("blockwise", True), ("mxfp8", False)])
def test_a_moe_model_trains_the_same_on_offsets_and_on_the_loop(recipe, bf16, monkeypatch):
    """Loss and every gradient of a tiny Qwen3-MoE: the device-offsets path equals the forced loop
    (``bf16``: the forward in bf16 autocast, backward outside it, as the training loop runs them)."""
    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(4))
    results, calls = [], []
    on_offsets = experts_module.fp8_grouped_linear_offsets
    monkeypatch.setattr(
        experts_module, "fp8_grouped_linear_offsets", lambda *a: calls.append(1) or on_offsets(*a)
    )
    for offsets in (True, False):
        if not offsets:
            assert calls  # the first model ran on offsets
            monkeypatch.setattr(experts_module, "runs_on_offsets", lambda *args: False)
        model = convert_to_fp8(make_tiny_moe("qwen3_moe"), recipe)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters() if p.grad is not None]))
    (loss0, grads0), (loss1, grads1) = results
    assert len(calls) == 4  # two blocks x two projections, on offsets; none on the forced loop
    assert torch.equal(loss0, loss1) and len(grads0) == len(grads1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1, strict=True))
