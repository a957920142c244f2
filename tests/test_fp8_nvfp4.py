"""NVFP4 quantization (``infir2.fp8.nvfp4``) against torchao's NVFP4 reference, bit for bit, and the
properties of stochastic rounding and the random Hadamard transform."""

from __future__ import annotations

import pytest
import torch

from infir2.fp8.formats import E2M1, FORMATS, NVFP4_BLOCK
from infir2.fp8.nvfp4 import (
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    hadamard_matrix,
    hadamard_transform,
    pack_nibbles,
    quantize_nvfp4,
    unpack_nibbles,
)

nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
mx_kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")


def torchao_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's two-level NVFP4 quantization (1x16 blocks): (packed codes, e4m3 scales, tensor scale)."""
    ts = nvfp4_tensor.per_tensor_amax_to_scale(x.float().abs().amax())
    scales, packed = nvfp4_tensor.nvfp4_quantize(x.contiguous(), NVFP4_BLOCK, ts)
    return packed, scales, ts


def assert_same_as_torchao(x: torch.Tensor) -> None:
    data, bs_inv, ts_inv = quantize_nvfp4(x, (1, NVFP4_BLOCK))
    packed, scales, ts = torchao_quantize(x)
    assert torch.equal(ts_inv, ts)
    assert torch.equal(bs_inv.view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(pack_nibbles(data), packed)


@pytest.mark.parametrize("shape", [(16, 16), (32, 64), (7, 48), (1, 256)])
@pytest.mark.parametrize("magnitude", [1e-20, 1e-3, 1.0, 448.0, 1e20])
def test_quantize_equals_torchao(shape, magnitude):
    g = torch.Generator().manual_seed(hash((shape, magnitude)) % 2**31)
    x = torch.randn(shape, generator=g) * magnitude
    x[0, : NVFP4_BLOCK // 2] = 0  # part of a block zero
    if shape[0] > 2:
        x[1] = 0  # whole zero blocks
        x[2, :NVFP4_BLOCK] *= 1e4  # an outlier block
    assert_same_as_torchao(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_equals_torchao_heavy_tails(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 128, generator=g) * torch.exp(3 * torch.randn(64, 128, generator=g))).to(dtype)
    assert_same_as_torchao(x)


def test_encode_equals_torchao_elementwise():
    """Every grid point, every midpoint (the ties), their neighbours, saturation and signed zeros."""
    grid = torch.tensor(E2M1.values)
    mids = (grid[1:] + grid[:-1]) / 2
    pts = torch.cat([grid, mids, torch.tensor([6.5, 7.0, 100.0, 1e-30, 0.24, 0.26])])
    pts = torch.cat([pts, pts.nextafter(torch.tensor(0.0)), pts.nextafter(torch.tensor(10.0))])
    pts = torch.cat([pts, -pts]).float()
    assert torch.equal(e2m1_encode(pts), mx_kernels.f32_to_f4_unpacked(pts))
    g = torch.Generator().manual_seed(2)
    y = torch.randn(4096, generator=g) * 4
    assert torch.equal(e2m1_encode(y), mx_kernels.f32_to_f4_unpacked(y))


def test_decode_equals_torchao():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(e2m1_decode(codes), mx_kernels.f4_unpacked_to_f32(codes))


def test_pack_round_trip():
    codes = torch.randint(0, 16, (8, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(pack_nibbles(codes), mx_kernels.pack_uint4(codes))
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


def test_weight_blocks_16x16():
    """16x16 blocks: where every row of a block holds the block's amax, the 1x16 blocks see the same
    amax, so torchao's 1x16 quantization is the oracle; and Q(W.T) is Q(W).T (one copy for fprop/dgrad)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(48, 64, generator=g)
    blocks = w.reshape(3, 16, 4, 16)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True) * 1.5  # [3, 1, 4, 1]
    blocks[:, :, :, 0] = amax[:, :, :, 0] * torch.sign(torch.randn(3, 16, 4, generator=g))
    data, bs_inv, ts_inv = quantize_nvfp4(w, (NVFP4_BLOCK, NVFP4_BLOCK))
    packed, scales, ts = torchao_quantize(w)
    assert torch.equal(ts_inv, ts)
    assert bs_inv.shape == (3, 4)
    assert torch.equal(pack_nibbles(data), packed)
    assert torch.equal(bs_inv.view(torch.uint8), scales.view(torch.uint8)[::NVFP4_BLOCK])
    w2 = torch.randn(40, 72, generator=g)
    d, s, t = quantize_nvfp4(w2, (NVFP4_BLOCK, NVFP4_BLOCK))
    dt, st, tt = quantize_nvfp4(w2.t(), (NVFP4_BLOCK, NVFP4_BLOCK))
    assert (
        torch.equal(t, tt)
        and torch.equal(d.t(), dt)
        and torch.equal(s.t().view(torch.uint8), st.view(torch.uint8))
    )


def test_column_blocks_are_row_blocks_of_the_transpose():
    x = torch.randn(64, 24, generator=torch.Generator().manual_seed(5))
    d, s, t = quantize_nvfp4(x, (NVFP4_BLOCK, 1))
    packed, scales, ts = torchao_quantize(x.t().contiguous())
    assert torch.equal(t, ts)
    assert torch.equal(pack_nibbles(d.t().contiguous()), packed)
    assert torch.equal(s.t().view(torch.uint8), scales.view(torch.uint8))


def test_dequantize_against_fp64():
    """x' = value(code) * block_scale * tensor_scale, computed independently in fp64; and the error
    is at most half a spacing of the largest E2M1 binade per block (RNE) for unsaturated blocks."""
    x = torch.randn(32, 48, generator=torch.Generator().manual_seed(6)) * 3
    data, bs_inv, ts_inv = quantize_nvfp4(x)
    values = torch.tensor(E2M1.values, dtype=torch.float64)
    ref = values[(data & 7).long()] * torch.where((data & 8) != 0, -1.0, 1.0).double()
    ref = ref * (bs_inv.double() * ts_inv.double()).repeat_interleave(NVFP4_BLOCK, 1)[:, :48]
    out = dequantize_nvfp4(data, bs_inv, ts_inv, (1, NVFP4_BLOCK), torch.float64)
    torch.testing.assert_close(out, ref, rtol=2**-23, atol=0)
    step = (bs_inv.double() * ts_inv.double()).repeat_interleave(NVFP4_BLOCK, 1)  # spacing 2 at the top
    assert ((out - x.double()).abs() <= step * 1.0 + 1e-6 * x.abs().double()).all()


def test_zeros_and_non_finite():
    data, bs_inv, ts_inv = quantize_nvfp4(torch.zeros(4, 32))
    assert ts_inv.item() == 1.0 and not data.any()
    assert not dequantize_nvfp4(data, bs_inv, ts_inv, (1, NVFP4_BLOCK)).any()
    x = torch.randn(4, 32)
    x[1, 3] = float("inf")
    data, bs_inv, ts_inv = quantize_nvfp4(x)
    assert dequantize_nvfp4(data, bs_inv, ts_inv, (1, NVFP4_BLOCK)).isnan().all()  # never hidden


def test_bad_blocks():
    with pytest.raises(ValueError, match="NVFP4 blocks"):
        quantize_nvfp4(torch.randn(4, 32), (1, 32))
    with pytest.raises(ValueError, match="rounding"):
        quantize_nvfp4(torch.randn(4, 32), rounding="up")


# --- stochastic rounding ------------------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased():
    """E[q(y)] = y inside the range: the mean over many draws is within 5 standard errors of y, where
    nearest rounding misses by up to half a spacing (its bias, shown on the same points)."""
    y = torch.linspace(-5.9, 5.9, 97)
    draws = 4000
    g = torch.Generator().manual_seed(7)
    noise = torch.rand(draws, y.numel(), generator=g)
    mean = e2m1_decode(e2m1_encode(y.expand(draws, -1), noise)).double().mean(0)
    spacing = torch.where(y.abs() < 2, 0.5, torch.where(y.abs() < 4, 1.0, 2.0)).double()
    stderr = spacing / 2 / draws**0.5  # the std of one draw is at most spacing / 2
    assert ((mean - y.double()).abs() <= 5 * stderr).all()
    nearest_bias = (e2m1_decode(e2m1_encode(y)).double() - y.double()).abs()
    assert nearest_bias.max() > 10 * stderr.max()


def test_stochastic_rounding_lower_error_on_gradients():
    """TransformerEngine's test: averaged over draws, stochastic rounding of a gradient-like tensor is
    closer to it than nearest rounding (whose errors do not average out)."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 128, generator=g) * 1e-3
    nearest = dequantize_nvfp4(*quantize_nvfp4(x), (1, NVFP4_BLOCK))
    draws = [
        dequantize_nvfp4(*quantize_nvfp4(x, rounding="stochastic", generator=g), (1, NVFP4_BLOCK))
        for _ in range(32)
    ]
    mean_sr = torch.stack(draws).mean(0)
    rmse = lambda a: (a - x).pow(2).mean().sqrt().item()  # noqa: E731
    assert rmse(mean_sr) < 0.5 * rmse(nearest)


def test_stochastic_rounding_is_seeded():
    x = torch.randn(16, 64)
    a = quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(9))[0]
    b = quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(9))[0]
    c = quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(10))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(11)  # no generator: torch's default one (saved and restored by a checkpoint)
    d = quantize_nvfp4(x, rounding="stochastic")[0]
    torch.manual_seed(11)
    assert torch.equal(d, quantize_nvfp4(x, rounding="stochastic")[0])


# --- random Hadamard transform ------------------------------------------------------------------------


def test_hadamard_is_orthogonal_with_fixed_signs():
    h = hadamard_matrix()
    assert h.shape == (NVFP4_BLOCK, NVFP4_BLOCK)
    assert torch.equal(h @ h.t(), torch.eye(NVFP4_BLOCK))  # entries +-1/4: exact in fp32
    assert torch.equal(h, hadamard_matrix.__wrapped__())  # the same signs every time
    signs = torch.sign(h[0])
    assert (signs > 0).any() and (signs < 0).any()  # a random sign vector, not plain Sylvester


def test_hadamard_keeps_the_wgrad_product():
    """(H dY)^T (H X) = dY^T X in fp64, with a token count that needs padding."""
    g = torch.Generator().manual_seed(12)
    dy = torch.randn(40, 24, generator=g, dtype=torch.float64)
    x = torch.randn(40, 32, generator=g, dtype=torch.float64)
    hdy, hx = hadamard_transform(dy), hadamard_transform(x)
    assert hdy.shape == (48, 24)
    torch.testing.assert_close(hdy.t() @ hx, dy.t() @ x, rtol=1e-12, atol=1e-12)


def test_hadamard_spreads_an_outlier():
    x = torch.zeros(NVFP4_BLOCK, 1)
    x[3] = 1.0
    assert torch.equal(hadamard_transform(x).abs(), torch.full((NVFP4_BLOCK, 1), 0.25))


def test_constants_come_from_the_formats():
    assert E2M1.max == 6.0 and FORMATS["e4m3"].max == 448.0 and NVFP4_BLOCK == 16


def test_noise_generator_context_and_seed():
    """Inside ``noise_generator`` the draws come from its generator, whatever torch's own generator is."""
    from infir2.fp8.nvfp4 import noise_generator, noise_seed

    x = torch.randn(16, 64)
    seed = noise_seed(0, 3, 1)
    assert seed == noise_seed(0, 3, 1) and len({seed, noise_seed(0, 3, 0), noise_seed(0, 4, 1)}) == 3
    with noise_generator(torch.Generator().manual_seed(seed)):
        torch.manual_seed(1)
        a = quantize_nvfp4(x, rounding="stochastic")[0]
    with noise_generator(torch.Generator().manual_seed(seed)):
        torch.manual_seed(2)
        b = quantize_nvfp4(x, rounding="stochastic")[0]
    direct = quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(seed))[0]
    assert torch.equal(a, b) and torch.equal(a, direct)


# --- "4 over 6" ---------------------------------------------------------------------------------------


def _block_errors(x: torch.Tensor, four_over_six: bool) -> tuple[torch.Tensor, torch.Tensor]:
    data, bs_inv, ts_inv = quantize_nvfp4(x, four_over_six=four_over_six)
    err = dequantize_nvfp4(data, bs_inv, ts_inv, (1, NVFP4_BLOCK), torch.float64) - x.double()
    return err.pow(2).reshape(x.shape[0], -1, NVFP4_BLOCK).sum(-1), bs_inv


def test_four_over_six_never_errs_more_per_block():
    """Each block keeps the 6-mapping or the 4-mapping, whichever errs less (fp64 squared error): no block
    is worse than plain NVFP4, some are strictly better, and the total error falls on Gaussian data."""
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(13))
    err6, bs6 = _block_errors(x, False)
    err46, bs46 = _block_errors(x, True)
    assert (err46 <= err6 * (1 + 1e-6)).all()
    changed = bs46.view(torch.uint8) != bs6.view(torch.uint8)
    assert changed.any() and (err46[changed] < err6[changed]).all()
    assert err46.sum() < 0.95 * err6.sum()


def test_four_over_six_block_scales_map_to_four():
    """Where a block took the 4-mapping its scale is e4m3(amax / 4 / tensor_scale_inv) clamped to 448:
    unclamped, its codes reach 4 but never 6; the block holding the tensor's amax keeps 6 (its 4-scale
    would pass 448, and clamped it is the 6-scale)."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(14))
    data, bs_inv, ts_inv = quantize_nvfp4(x, four_over_six=True)
    _, bs6, _ = quantize_nvfp4(x)
    took4 = bs_inv.view(torch.uint8) != bs6.view(torch.uint8)
    amax = x.abs().reshape(64, -1, NVFP4_BLOCK).amax(-1)
    expected = (amax / 4 / ts_inv).clamp(2**-6, FORMATS["e4m3"].max).to(torch.float8_e4m3fn)
    assert torch.equal(bs_inv[took4].view(torch.uint8), expected[took4].view(torch.uint8))
    top = (data & 7).reshape(64, -1, NVFP4_BLOCK).amax(-1)  # the largest magnitude code per block
    unclamped = took4 & (amax / 4 / ts_inv < FORMATS["e4m3"].max)  # else the scale stops at 448
    assert unclamped.any() and (top[unclamped] <= E2M1.values.index(4.0)).all()
    i, j = divmod(int(x.abs().argmax()), 128)
    assert not took4[i, j // NVFP4_BLOCK]


def test_four_over_six_is_for_nearest_rounding():
    with pytest.raises(ValueError, match="four_over_six"):
        quantize_nvfp4(torch.randn(4, 32), rounding="stochastic", four_over_six=True)
