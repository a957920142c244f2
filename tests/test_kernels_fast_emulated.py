"""The fast CPU emulation (``infir2.kernels.fast_emulated``) against the reference quantizer, bit for bit.

Every test runs twice: with the C kernel (``kernels.native``, built with the machine's C compiler)
and with the eager torch code that runs without one. Oracles: ``infir2.fp8.quantize`` (quantize / dequantize), torch's own ``.to(float8)`` cast for the
rounding of single values, torch's fp8 -> fp32 conversion for decoding, and the ``emulated``
backend for GEMMs and a whole model's loss and gradients.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import make_tiny_model
from infir2.fp8.formats import bit_layout, get_format
from infir2.fp8.quantize import dequantize, quantize
from infir2.fp8.recipe import Cast
from infir2.kernels import emulated, native
from infir2.kernels import fast_emulated as fe
from infir2.nn import convert_to_fp8

FORMATS = ("e4m3", "e5m2")


@pytest.fixture(autouse=True, params=["native", "eager"])
def path(request, monkeypatch):
    """Run the test on the C kernel, then on the eager torch code (the kernel switched off)."""
    if request.param == "native":
        if not native.available():
            pytest.skip(f"the C kernel is not available here: {native.why_unavailable()}")
    else:
        monkeypatch.setitem(native._state, "error", "switched off by the test")
    return request.param


BLOCKS = [(1, 128), (128, 1), (128, 128), (1, -1), (-1, 1), (-1, -1), (1, 32), (32, 1)]
SHAPES = [(256, 256), (130, 200), (1, 1), (3, 129)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and bit patterns (NaN payloads and the sign of zero included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.dtype.itemsize]
    return torch.equal(a.contiguous().view(int_type), b.contiguous().view(int_type))


def assert_matches_reference(x: torch.Tensor, block, fmt: str, encoding: str) -> None:
    data, scale_inv = quantize(x, block, fmt, encoding)
    fast_data, fast_scale_inv, fast_deq = fe.quantize_kept(x, block, fmt, encoding)
    where = f"{fmt} {encoding} block={block} shape={tuple(x.shape)} {x.dtype}"
    assert same_bits(fast_data, data), f"data differs: {where}"
    assert same_bits(fast_scale_inv, scale_inv), f"scale_inv differs: {where}"
    assert same_bits(fast_deq, dequantize(data, scale_inv, block)), f"dequantized differs: {where}"
    assert same_bits(fe.dequantize(data, scale_inv, block), dequantize(data, scale_inv, block)), where


def hard_tensor(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Log-normal magnitudes over ~8 decades, a zero row, -0.0, a 1e4x outlier, fp32-tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(3 * torch.randn(shape, generator=g))
    m, k = shape
    if m > 2:
        x[1] = 0.0
        x[2, 0] = -0.0
    if m * k > 4:
        flat = x.view(-1)
        flat[3] = 1e4 * x.abs().max()
        flat[-1] = 1e-39  # an fp32 subnormal
        flat[-2] = -3e-30
    return x.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("encoding", ["pow2", "fp32"])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_bit_identical_to_reference(fmt, encoding, block, dtype):
    for i, shape in enumerate(SHAPES):
        assert_matches_reference(hard_tensor(shape, dtype, seed=i), block, fmt, encoding)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block", [(1, 128), (128, 1), (128, 128), (-1, -1)])
def test_zero_blocks_and_subnormal_results(fmt, block):
    x = torch.zeros(256, 256)
    x[0, 0] = 1.0  # one block whose other elements are far below its scale: FP8 subnormals and zeros
    x[0, 1:200] = torch.logspace(-12, 0, 199)
    x[130:, 130:] = torch.logspace(-44, -38, 126 * 126).view(126, 126)  # fp32 subnormals only
    for encoding in ("pow2", "fp32"):
        assert_matches_reference(x, block, fmt, encoding)
        assert_matches_reference(-x, block, fmt, encoding)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block", BLOCKS)
def test_nonfinite_like_reference(fmt, block):
    x = hard_tensor((130, 200), torch.float32, seed=7)
    x[0, 5], x[4, 64], x[129, 199], x[60, 3] = float("inf"), float("-inf"), float("nan"), -float("nan")
    assert_matches_reference(x, block, fmt, "pow2")
    data = fe.quantize_kept(x, block, fmt, "pow2")[0].float()
    assert torch.isnan(data[129, 199]) and torch.isnan(data[60, 3])
    assert torch.isinf(data[0, 5]) == get_format(fmt).has_inf  # inf -> NaN in E4M3, stays in E5M2


def boundary_sweep(fmt: str, ulps: int = 6) -> torch.Tensor:
    """Every FP8 value, every midpoint between neighbours, and their ``ulps`` fp32 neighbours each way,
    both signs, plus the fp32 subnormals near zero and values just past fmax."""
    f = get_format(fmt)
    codes = torch.arange(0, 128, dtype=torch.int32).to(torch.uint8).view(f.dtype).float()
    grid = codes[torch.isfinite(codes)].unique()  # 0 .. fmax
    mid = (grid[:-1] + grid[1:]) / 2  # exact in fp32
    past = torch.tensor([f.max * 1.0625, f.max * 1.125, f.max * 2, 3.0e38])
    centres = torch.cat([grid, mid, past]).view(torch.int32)
    steps = torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    sweep = (centres[:, None] + steps[None, :]).clamp_(min=0).flatten().view(torch.float32)
    tiny = torch.arange(0, 64, dtype=torch.int32).view(torch.float32)  # fp32 subnormals
    values = torch.cat([sweep, tiny])
    return torch.cat([values, -values])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("encoding", ["pow2", "fp32"])
def test_rounding_boundaries_exhaustive(fmt, encoding):
    """Each value of the sweep, alone in a block with fmax (so the scale is exactly 1), quantizes
    and dequantizes as torch's own cast of it; past fmax, the scale shrinks and both paths agree."""
    f = get_format(fmt)
    v = boundary_sweep(fmt)
    within = v[v.abs() <= f.max]
    rows = torch.stack([within, torch.full_like(within, f.max)], dim=1)  # [n, 2]: one block per row
    data, scale_inv, deq = fe.quantize_kept(rows, (1, -1), fmt, encoding)
    assert torch.all(scale_inv == 1.0)
    assert same_bits(data, rows.to(f.dtype))  # torch's round-to-nearest-even cast
    assert same_bits(deq, rows.to(f.dtype).float())
    past = v[v.abs() > f.max]
    assert_matches_reference(torch.stack([past, within[: past.numel()]], dim=1), (1, -1), fmt, encoding)
    assert_matches_reference(v[None, :], (1, 128), fmt, encoding)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_decodes_every_code(fmt):
    f = get_format(fmt)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(f.dtype).view(16, 16)
    for scale_inv in (1.0, 2.0**-20, 3.0e-5, 2.0**100):  # 2**100 * 2**bias overflows: unfolded path
        s = torch.full((1, 1), scale_inv)
        assert same_bits(fe.dequantize(codes, s, (-1, -1)), dequantize(codes, s, (-1, -1)))
    finite = codes.view(-1)[torch.isfinite(codes.float().view(-1))][None, :]  # the integer-decode path
    s = torch.full((1, 1), 0.75)
    assert same_bits(fe.dequantize(finite, s, (1, -1)), dequantize(finite, s, (1, -1)))


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="2-D"):
        fe.quantize_kept(torch.zeros(4), (1, 128))
    with pytest.raises(ValueError, match="floating-point"):
        fe.quantize_kept(torch.zeros(4, 4, dtype=torch.int32), (1, 128))
    data, scale_inv = quantize(torch.randn(4, 256), (1, 128))
    with pytest.raises(ValueError, match="scale_inv shape"):
        fe.dequantize(data, scale_inv.t(), (1, 128))


@pytest.mark.parametrize("shape", [(512, 128, 512), (200, 130, 77), (129, 256, 128)])
@pytest.mark.parametrize(
    "recipe_blocks",
    [
        ((1, 128), (128, 128), (128, 128), (128, 1)),
        ((1, -1), (1, -1), (-1, 1), (-1, 1)),
        ((-1, -1), (-1, -1), (-1, -1), (-1, -1)),
    ],
)
def test_three_gemms_bit_identical_to_emulated(shape, recipe_blocks):
    """Fp8Linear's fprop, dgrad and wgrad: kept operands (and the decoded FP8 wgrad copy of X)."""
    t, k, n = shape
    act, weight, dgrad_weight, token = recipe_blocks
    g = torch.Generator().manual_seed(0)
    x, w, dy = (
        torch.randn(t, k, generator=g),
        0.05 * torch.randn(n, k, generator=g),
        torch.randn(t, n, generator=g),
    )

    def ref(x, block, fmt, encoding):
        return emulated.quantize(x, Cast(block, fmt, encoding))

    def fast(x, block, fmt, encoding):
        return fe.quantize(x, Cast(block, fmt, encoding))

    cases = [((x, act), (w, weight), False), ((dy, act), (w, dgrad_weight), True)]
    for (a, a_block), (b, b_block), transpose_b in cases:  # fprop [T,K]@[K,N], dgrad [T,N]@[N,K]
        ra, rb = ref(a, a_block, "e4m3", "pow2"), ref(b, b_block, "e4m3", "pow2")
        fa, fb = fast(a, a_block, "e4m3", "pow2"), fast(b, b_block, "e4m3", "pow2")
        expected = emulated.gemm_nt(ra, rb.t() if transpose_b else rb, torch.float32)
        assert same_bits(fe.gemm_nt(fa, fb.t() if transpose_b else fb, torch.float32), expected)
    # wgrad [N,T] @ [T,K]: dY kept, X from its stored FP8 bytes (what backward has)
    dy_w, x_w = fast(dy, token, "e4m3", "pow2"), fast(x, token, "e4m3", "pow2")
    expected = emulated.gemm_nt(
        ref(dy, token, "e4m3", "pow2").t(), ref(x, token, "e4m3", "pow2").t(), torch.float32
    )
    assert same_bits(fe.gemm_nt(dy_w.t(), x_w.stored().t(), torch.float32), expected)
    assert same_bits(fe.gemm_nt(dy_w.t(), x_w.t(), torch.float32), expected)


def _activations_and_grads(model, ids):
    """Inputs and output gradients of every nn.Linear of ``model`` for one loss.backward()."""
    seen: list[torch.Tensor] = []
    hooks = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_hook(lambda m, inp, out: seen.append(inp[0].detach())))
            hooks.append(module.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].detach())))
    model(input_ids=ids, labels=ids).loss.backward()
    for h in hooks:
        h.remove()
    return [t.reshape(-1, t.shape[-1]) for t in seen]


@pytest.mark.slow
def test_real_activations_and_gradients():
    model = make_tiny_model("qwen2", hidden=128, layers=1)
    ids = torch.randint(0, 300, (2, 80), generator=torch.Generator().manual_seed(0))
    tensors = _activations_and_grads(model, ids)  # 7 projections + lm_head, inputs and output grads
    assert len(tensors) == 2 * 8
    cases = [((1, 128), "e4m3", "pow2"), ((128, 1), "e4m3", "pow2"), ((1, -1), "e5m2", "fp32")]
    for i, (x, (block, fmt, encoding)) in enumerate(itertools.product(tensors, cases)):
        assert_matches_reference(x if i % 2 else x.bfloat16(), block, fmt, encoding)


@pytest.mark.slow
def test_whole_model_step_bit_identical_to_emulated():
    """A 4-layer Qwen2 with every linear in FP8: loss and every gradient equal the emulated backend's."""
    ids = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(1))
    results = []
    for backend in ("emulated", "fast_emulated"):
        model = convert_to_fp8(make_tiny_model("qwen2", hidden=128, layers=4), "blockwise", backend=backend)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    assert all(same_bits(a, b) for a, b in zip(*results, strict=True))


def test_operand_pair_and_kept_operand():
    """quantize_pair: the first tiling kept, the second FP8 only (kept too where the C kernel wrote
    its fp32 copy anyway); both equal the reference."""
    x = hard_tensor((256, 384), torch.float32, seed=3)
    first, second = fe.quantize_pair(x, Cast((1, 128)), Cast((128, 1)))
    assert first.dequantized is not None and (second.dequantized is None) == (not native.available())
    for op, block in ((first, (1, 128)), (second, (128, 1))):
        data, scale_inv = quantize(x, block)
        assert same_bits(op.data, data) and same_bits(op.scale_inv, scale_inv)
        assert same_bits(op.dequantize(), dequantize(data, scale_inv, block))
        assert same_bits(op.t().dequantize(), dequantize(data.t(), scale_inv.t(), block[::-1]))
    assert type(first.stored()) is not fe.KeptOperand and first.stored().data is first.data


def test_the_c_kernel_is_what_runs(path, monkeypatch):
    """Where a C compiler exists the kernel is built and used (not silently skipped); without it
    (or with INFIR2_NATIVE=0) the reason is given and the eager code runs."""
    if path == "eager":
        assert not native.available() and native.why_unavailable() == "switched off by the test"
        return
    x = torch.randn(256, 256)
    calls = []
    monkeypatch.setattr(native, "quantize", lambda *a, **k: calls.append(a) or None)
    fe.quantize_kept(x, (1, 128))  # the spy returns None: the eager code finishes the job
    assert len(calls) == 1 and calls[0][1:3] == (1, 128)


def test_native_off_by_environment(monkeypatch):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("INFIR2_NATIVE", "0")
    assert (
        native.why_unavailable() == "INFIR2_NATIVE=0"
        and native.quantize(
            torch.ones(128, 128),
            1,
            128,
            448.0,
            "pow2",
            bit_layout("e4m3"),
            torch.float8_e4m3fn,
            True,
        )
        is None
    )


def test_the_weight_cache_keeps_one_byte_per_weight_on_a_cpu():
    """A weight quantized for the whole step (``cache_fp8_weights``) keeps its FP8 bytes and scales
    only, not an fp32 copy (4 more bytes per weight: CPU FP8 memory above the baseline's); the GEMMs
    decode it and give the same bits as the kept copy did."""
    from infir2.nn import Fp8Linear, cache_fp8_weights

    model = convert_to_fp8(
        make_tiny_model("qwen2", hidden=128, layers=1), "blockwise", backend="fast_emulated"
    )
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with cache_fp8_weights(model):
        model(input_ids=ids, labels=ids).loss.backward()
        layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
        for layer in layers:
            op = layer.quantized_weight()
            assert getattr(op, "dequantized", None) is None, "an fp32 copy of the weight is kept all step"
            assert op.nbytes() <= layer.weight.numel() * (1 + 4 / 128**2) + 4 * 4
    cast = Cast((128, 128))
    w = hard_tensor((256, 384), torch.float32, seed=5)
    kept, plain = fe.quantize_kept_operand(w, cast), fe.quantize(w, cast)
    x = fe.quantize_kept_operand(hard_tensor((64, 384), torch.float32, seed=6), Cast((1, 128)))
    assert same_bits(fe.gemm_nt(x, kept, torch.float32), fe.gemm_nt(x, plain, torch.float32))
