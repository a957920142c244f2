"""Fp8Linear: numerics against fp64, what it saves for backward, backends, and torchao as an oracle."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from infir2 import Fp8Linear, sqnr
from infir2.fp8 import get_recipe
from infir2.kernels import BACKENDS, bind
from infir2.nn import cache_fp8_weights

SHAPES = [(256, 256, 384), (100, 200, 300)]  # (tokens, in_features, out_features): multiples of 128 and not


def fp64_reference(x, weight, bias, grad):
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_() if bias is not None else None
    y = nn.functional.linear(x64, w64, b64)
    y.backward(grad.double())
    return y, x64.grad, w64.grad


def run_fp8(layer, x, grad):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(grad)
    return y, x.grad, layer.weight.grad


@pytest.mark.parametrize("recipe", ["blockwise", "blockwise_fp32scale", "mxfp8", "rowwise", "tensorwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "k", "n"), SHAPES)
def test_fp8_linear_sqnr_vs_fp64(recipe, dtype, t, k, n):
    torch.manual_seed(0)
    layer = Fp8Linear(k, n, bias=True, recipe=recipe)
    x = torch.randn(2, t // 2, k).to(dtype)  # leading batch dims are flattened to tokens
    grad = torch.randn(2, t // 2, n).to(dtype)
    y, dx, dw = run_fp8(layer, x, grad)
    y_ref, dx_ref, dw_ref = fp64_reference(x, layer.weight, layer.bias, grad)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == torch.float32
    assert y.shape == (2, t // 2, n) and dx.shape == x.shape
    assert sqnr(y_ref, y) >= 25
    assert sqnr(dx_ref, dx) >= 25
    assert sqnr(dw_ref, dw) >= 25
    assert sqnr(grad.double().sum((0, 1)), layer.bias.grad) >= 40  # bias grad is a plain fp32 sum


def test_fp8_linear_matches_emulated_composition_exactly():
    """The autograd function is exactly the three GEMMs of the recipe table on dequantized operands."""
    from infir2.fp8 import dequantize, quantize

    torch.manual_seed(1)
    t, k, n = 130, 256, 384
    layer = Fp8Linear(k, n, bias=False)
    x = torch.randn(t, k)
    g = torch.randn(t, n)
    y, dx, dw = run_fp8(layer, x, g)

    def q(a, block):
        return dequantize(*quantize(a, block), block)

    w = layer.weight.detach()
    assert torch.allclose(y, q(x, (1, 128)) @ q(w, (128, 128)).t(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(dx, q(g, (1, 128)) @ q(w, (128, 128)), rtol=1e-5, atol=1e-5)
    assert torch.allclose(dw, q(g, (128, 1)).t() @ q(x, (128, 1)), rtol=1e-5, atol=1e-4)


def test_mxfp8_linear_is_the_mx_table_on_dequantized_operands():
    """MXFP8: 1x32 blocks along every reduction (32x1 for the operands read transposed), E8M0 scales;
    the weight is quantized twice (its fprop and dgrad blocks differ), each from the fp32 original."""
    from infir2.fp8 import dequantize, quantize

    torch.manual_seed(1)
    t, k, n = 70, 96, 80  # nothing a multiple of 128: MX blocks only need multiples of 32 to be whole
    layer = Fp8Linear(k, n, bias=False, recipe="mxfp8")
    x, g = torch.randn(t, k), torch.randn(t, n)
    y, dx, dw = run_fp8(layer, x, g)

    def q(a, block):
        data, scale_inv = quantize(a, block, "e4m3", "e8m0")
        assert scale_inv.dtype == torch.float8_e8m0fnu
        return dequantize(data, scale_inv, block)

    w = layer.weight.detach()
    assert torch.allclose(y, q(x, (1, 32)) @ q(w, (1, 32)).t(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(dx, q(g, (1, 32)) @ q(w, (32, 1)), rtol=1e-5, atol=1e-5)
    assert torch.allclose(dw, q(g, (32, 1)).t() @ q(x, (32, 1)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8", "rowwise", "tensorwise"])
def test_saved_activation_is_fp8(recipe):
    layer = Fp8Linear(256, 384, recipe=recipe)
    x = torch.randn(64, 256, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum().backward()
    activations = [t for t in saved if t.shape == x.shape]
    assert activations and all(t.dtype == torch.float8_e4m3fn for t in activations)
    high_precision = [
        t for t in saved if t.dtype.is_floating_point and t.dtype.itemsize > 1 and t.numel() > 64
    ]
    # only the weight (a parameter: no extra memory) and fp32 scales may be in high precision
    assert all(
        t is layer.weight or (t.dtype == torch.float32 and t.numel() < x.numel() // 16)
        for t in high_precision
    )
    assert not any(t.data_ptr() == x.data_ptr() for t in saved)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_scaled_mm_backend_agrees_with_emulated(recipe):
    torch.manual_seed(2)
    base = nn.Linear(200, 300)
    x = torch.randn(96, 200)
    g = torch.randn(96, 300)
    outs = {}
    for backend in ["emulated", "scaled_mm"]:
        layer = Fp8Linear.from_linear(copy.deepcopy(base), recipe, backend=backend)
        outs[backend] = run_fp8(layer, x, g)
    for a, b in zip(outs["emulated"], outs["scaled_mm"], strict=True):
        # identical FP8 operands and exact products: only the fp32 summation order differs
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_backend_selection_and_errors(caplog):
    with caplog.at_level(logging.INFO):
        assert bind(get_recipe("blockwise"), "cpu").name == "fast_emulated"  # exact, integer-decoded
        assert bind(get_recipe("mxfp8"), "cpu").name == "emulated"  # E8M0 scales: the reference
        assert bind(get_recipe("rowwise"), "cpu").name == "fast_emulated"  # faster than CPU _scaled_mm
        assert bind(get_recipe("rowwise"), "cpu", "scaled_mm").name == "scaled_mm"  # when asked for
    with pytest.raises(ValueError, match="unknown FP8 backend 'cutlass'"):
        bind(get_recipe("blockwise"), "cpu", "cutlass")
    with pytest.raises(ValueError, match="cannot run recipe 'blockwise'"):
        bind(get_recipe("blockwise"), "cpu", "triton")
    assert set(BACKENDS) >= {"emulated", "scaled_mm"}


def _torchao_layer(base: nn.Linear, recipe: str):
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.config import CastConfig

    if recipe == "rowwise":
        config = Float8LinearConfig.from_recipe_name("rowwise")  # E4M3 everywhere, pow2 scales
    else:  # torchao's tensorwise default casts grads to E5M2; the recipe uses E4M3 everywhere
        config = Float8LinearConfig(cast_config_grad_output=CastConfig(target_dtype=torch.float8_e4m3fn))
    model = nn.Sequential(copy.deepcopy(base))
    convert_to_float8_training(model, config=config)
    return model


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_agrees_with_torchao(recipe):
    torch.manual_seed(3)
    base = nn.Linear(256, 384, bias=False)
    x = torch.randn(64, 256)
    g = torch.randn(64, 384)
    theirs = _torchao_layer(base, recipe)
    ours = Fp8Linear.from_linear(copy.deepcopy(base), recipe)
    xa = x.clone().requires_grad_()
    ya = theirs(xa)
    ya.backward(g)
    yb, dxb, dwb = run_fp8(ours, x, g)
    results = [(ya, yb), (xa.grad, dxb), (theirs[0].weight.grad, dwb)]
    for a, b in results:
        if recipe == "rowwise":
            # torchao's rowwise GEMM rounds its output through bf16 on CPU; the FP8 operands are the same
            b = b.bfloat16().float()
        assert torch.equal(a, b) or sqnr(a, b) > 60


def test_weight_cache_quantizes_once_per_step_and_follows_updates(monkeypatch):
    layer = Fp8Linear(256, 256)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    calls = []
    backend = BACKENDS[layer.bind_kernels("cpu").name]
    original = backend.quantize

    def counting(x, cast):
        calls.append(tuple(cast.block))
        return original(x, cast)

    monkeypatch.setattr(backend, "quantize", counting)
    x = torch.randn(8, 256)
    with cache_fp8_weights(layer):
        for _ in range(3):  # three micro-batches, one optimizer step
            layer(x).sum().backward()
        assert calls.count((128, 128)) == 1
        y_before = layer(x).detach()
        opt.step()  # in-place update bumps the weight's version: the cache must not be reused
        y_after = layer(x).detach()
    assert calls.count((128, 128)) == 2
    assert not torch.equal(y_before, y_after)
    with torch.no_grad():
        expected = Fp8Linear.from_linear(layer, "blockwise")(x)
    assert torch.equal(y_after, expected)


def test_disabled_fp8_is_plain_linear():
    base = nn.Linear(64, 32)
    layer = Fp8Linear.from_linear(base)
    layer.fp8_enabled = False
    x = torch.randn(4, 64)
    assert torch.equal(layer(x), base(x))
    assert layer.weight is base.weight
    assert set(layer.state_dict()) == set(base.state_dict())


def test_dgrad_weight_is_kept_k_major_once_per_step():
    """On CUDA inside ``cache_fp8_weights`` the dgrad operand ``Q(W).T`` is stored K-major once per step
    (same values, reduction dimension contiguous) and backward gives the same gradients bit for bit.
    The device is only a label of the binding here: the emulated backend runs the GEMMs on CPU."""
    from infir2.kernels import Kernels
    from infir2.nn.linear import _Fp8LinearFunction

    torch.manual_seed(4)
    layer = Fp8Linear(256, 384, bias=False, backend="emulated")
    cuda_like = Kernels(layer.recipe, torch.device("cuda", 0), (BACKENDS["emulated"],))
    x, dy = torch.randn(64, 256), torch.randn(64, 384)
    grads = []
    with cache_fp8_weights(layer):
        w = layer.quantized_weight(cuda_like)
        wt = layer.dgrad_weight(w, cuda_like)
        assert wt is not None and wt.shape == (256, 384) and wt.data.is_contiguous()
        assert torch.equal(wt.dequantize(), w.dequantize().t())
        assert layer.dgrad_weight(w, cuda_like) is wt  # once per step
        for transposed in (None, wt):
            xi = x.clone().requires_grad_()
            layer.weight.grad = None
            args = (layer.weight, None, layer.recipe, cuda_like, w, None, None, transposed)
            y = _Fp8LinearFunction.apply(xi, *args)
            y.backward(dy)
            grads.append((y.detach(), xi.grad, layer.weight.grad.clone()))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    assert layer.dgrad_weight(w, cuda_like) is None  # outside the cache: backward uses the view
    with cache_fp8_weights(layer):
        cpu = layer.bind_kernels("cpu")
        assert layer.dgrad_weight(layer.quantized_weight(cpu), cpu) is None  # CPU: no copy


def _recording_chain(name: str, calls: list) -> object:
    """A chain on a faked CUDA device whose first backend (called ``name``) records each GEMM's operands
    and runs the emulated GEMM on the CPU tensors; quantization goes to the emulated backend."""
    from types import SimpleNamespace

    from infir2.kernels import Backend, Kernels, emulated

    def gemm_nt(a, b, out_dtype):
        calls.append((tuple(a.shape), tuple(b.shape), b.data.is_contiguous()))
        return emulated.gemm_nt(a, b, out_dtype)

    fake = Backend(SimpleNamespace(NAME=name, gemm_nt=gemm_nt))
    return Kernels(get_recipe("blockwise"), torch.device("cuda", 0), (fake, BACKENDS["emulated"]))


@pytest.mark.parametrize("tokens", [200, 256, 1])
def test_tokens_are_padded_to_whole_blocks_where_cublas_runs(tokens, monkeypatch):
    """On cuBLAS (faked: a CUDA chain led by ``scaled_mm``) every GEMM sees a multiple of 128 tokens, so
    the block-scaled wgrad is never declined; outputs and gradients are those of the unpadded layer."""
    calls: list = []
    torch.manual_seed(0)
    layer = Fp8Linear(256, 384, bias=True, backend="emulated")
    x = torch.randn(tokens, 256, requires_grad=True)
    dy = torch.randn(tokens, 384)
    y_ref = layer(x)
    y_ref.backward(dy)
    ref = (y_ref.detach(), x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone())
    x.grad = layer.weight.grad = layer.bias.grad = None
    fake = _recording_chain("scaled_mm", calls)
    monkeypatch.setattr(layer, "_kernels_on", lambda device: fake)
    y = layer(x)
    y.backward(dy)
    assert y.shape == (tokens, 384)
    padded = -(-tokens // 128) * 128
    fprop, dgrad, wgrad = calls
    assert fprop[0] == (padded, 256) and dgrad[0] == (padded, 384) and wgrad[0] == (384, padded)
    got = (y.detach(), x.grad, layer.weight.grad, layer.bias.grad)
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
    calls.clear()
    monkeypatch.setattr(layer, "_kernels_on", lambda device: _recording_chain("triton", calls))
    layer(x).backward(dy)  # Triton takes any token count: nothing is padded
    assert calls[0][0] == (tokens, 256)


def test_an_fsdp_gathered_weight_gets_the_k_major_dgrad_copy_in_backward():
    """A weight all-gathered by FSDP2 (an ``Fp8GatheredWeight``) on a GPU: the dgrad GEMM gets the
    transposed FP8 weight as a contiguous (K-major) copy made in backward, with the view's gradients."""
    from infir2.fp8.recipe import Cast
    from infir2.kernels import emulated
    from infir2.nn.fsdp import Fp8GatheredWeight
    from infir2.nn.linear import _Fp8LinearFunction

    recipe = get_recipe("blockwise")
    torch.manual_seed(0)
    w = torch.randn(384, 256)
    x = torch.randn(128, 256, requires_grad=True)
    dy = torch.randn(128, 384)
    operand = emulated.quantize(w, Cast((128, 128)))
    grads, layouts = [], []
    for gathered in (False, True):
        calls: list = []
        weight = (
            Fp8GatheredWeight(operand, torch.float32, requires_grad=True) if gathered else w.requires_grad_()
        )
        x.grad = None
        y = _Fp8LinearFunction.apply(x, weight, None, recipe, _recording_chain("triton", calls), operand)
        y.backward(dy)
        grads.append(x.grad.clone())
        layouts.append(calls[1])  # dgrad: dY [T, N] x W.T [K, N]
    assert layouts[0] == ((128, 384), (256, 384), False)  # the transposed view
    assert layouts[1] == ((128, 384), (256, 384), True)  # the K-major copy
    assert torch.equal(grads[0], grads[1])


def test_the_input_cache_lets_go_of_a_freed_input() -> None:
    """The FP8 copies of the last input (``linear._INPUT_CACHE``) go with that input: none outlives a
    step's backward (two ``[T, K]`` fp32 copies on a CPU); the layers fed the same input still share
    one quantization while it lives."""
    from infir2.nn.linear import _INPUT_CACHE

    a, b = Fp8Linear(256, 128), Fp8Linear(256, 128)
    x = torch.randn(128, 256, requires_grad=True)
    (a(x).sum() + b(x).sum()).backward()
    assert len(_INPUT_CACHE._ops) == 1  # one entry for both layers while x lives
    del x
    assert _INPUT_CACHE._ops == {} and _INPUT_CACHE._ref is None
