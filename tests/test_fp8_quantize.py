"""Block quantization against an independent numpy + ml_dtypes reference, bit for bit."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from infir2.fp8 import dequantize, get_format, get_recipe, quantize, sqnr

NP_DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
FLT_MAX = np.float32(np.finfo(np.float32).max)


def reference_quantize(x: np.ndarray, block, fmt: str, encoding: str):
    """Plain loops over blocks, fp32 scale, floor(log2) in fp64, saturating cast with ml_dtypes.

    ``encoding="e8m0"``: the MX rule, ``scale_inv = 2 ** ceil(log2(amax / fmax))`` in fp64, clamped to
    2**-127 .. 2**127, 1 for a zero or non-finite block."""
    dt = NP_DTYPES[fmt]
    fmax = np.float32(float(ml_dtypes.finfo(dt).max))
    m, k = x.shape
    bm = m if block[0] == -1 else block[0]
    bk = k if block[1] == -1 else block[1]
    mb, kb = math.ceil(m / bm), math.ceil(k / bk)
    data = np.zeros((m, k), dtype=dt)
    scale_inv = np.zeros((mb, kb), dtype=np.float32)
    for i in range(mb):
        for j in range(kb):
            blk = x[i * bm : (i + 1) * bm, j * bk : (j + 1) * bk].astype(np.float32)
            amax = np.float32(np.max(np.abs(blk)))
            if amax == 0 or not np.isfinite(amax):
                scale = np.float32(1.0)
            elif encoding == "e8m0":
                exp = int(np.clip(np.ceil(np.log2(np.float64(amax) / np.float64(fmax))), -127, 127))
                scale = np.float32(2.0**-exp)
            else:
                with np.errstate(over="ignore"):
                    scale = np.float32(fmax / amax)
                if np.isinf(scale):
                    scale = FLT_MAX
                if encoding == "pow2":
                    scale = np.float32(2.0 ** np.floor(np.log2(np.float64(scale))))
            with np.errstate(invalid="ignore", over="ignore"):
                y = blk * scale
            finite = np.clip(y, -fmax, fmax)
            inf_to = y if fmt == "e5m2" else np.full_like(y, np.nan)
            y = np.where(np.isinf(y), inf_to, finite)
            data[i * bm : (i + 1) * bm, j * bk : (j + 1) * bk] = y.astype(dt)
            scale_inv[i, j] = np.float32(1.0) / scale
    return data, scale_inv


def assert_same_fp8(ours: torch.Tensor, ref: np.ndarray) -> None:
    ours_f = ours.float().numpy()
    ref_f = ref.astype(np.float32)
    assert np.array_equal(np.isnan(ours_f), np.isnan(ref_f)), "NaN positions differ"
    keep = ~np.isnan(ref_f)
    # compare bit patterns, not values: -0 vs +0 and every rounding decision must agree
    assert np.array_equal(ours.view(torch.uint8).numpy()[keep], ref.view(np.uint8)[keep])


def special_input(shape, seed: int) -> torch.Tensor:
    """Gaussian data with a zero block, 1e4x outliers, tiny values, subnormal-scale values, inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    m, k = shape
    x = torch.randn(m, k, generator=g)
    x[: min(m, 3), : min(k, 130)] = 0.0  # an all-zero tile / part of a block
    x[min(m - 1, 5), min(k - 1, 7)] = 1e4 * x.abs().max()  # outlier
    if m > 8:
        x[8, :] = torch.randn(k, generator=g) * 1e-30  # tiny row
    if m > 9:
        x[9, :] = 1e-40  # subnormal fp32: fmax / amax overflows fp32 -> FLT_MAX
    if m > 10 and k > 3:
        x[10, 3] = float("inf")
        x[10, 1] = float("-inf")
    if m > 11 and k > 2:
        x[11, 2] = float("nan")
    return x


BLOCKS = [(1, 128), (128, 128), (128, 1), (1, -1), (-1, 1), (-1, -1), (32, 16)]
SHAPES = [(256, 384), (200, 300), (1, 5), (130, 129)]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("encoding", ["pow2", "fp32"])
def test_quantize_matches_reference_bit_exact(block, shape, encoding):
    x = special_input(shape, seed=hash((block, shape)) % 1000)
    data, scale_inv = quantize(x, block, "e4m3", encoding)
    ref_data, ref_scale_inv = reference_quantize(x.numpy(), block, "e4m3", encoding)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == ref_scale_inv.shape
    assert np.array_equal(scale_inv.numpy(), ref_scale_inv)
    assert_same_fp8(data, ref_data)
    # dequantize = data * scale_inv per block, in fp32
    deq = dequantize(data, scale_inv, block)
    bm = shape[0] if block[0] == -1 else block[0]
    bk = shape[1] if block[1] == -1 else block[1]
    full_scale = np.repeat(np.repeat(ref_scale_inv, bm, 0)[: shape[0]], bk, 1)[:, : shape[1]]
    assert np.array_equal(deq.numpy(), ref_data.astype(np.float32) * full_scale, equal_nan=True)


@pytest.mark.parametrize("encoding", ["pow2", "fp32"])
def test_e5m2_matches_reference(encoding):
    x = special_input((130, 260), seed=3)
    data, scale_inv = quantize(x, (1, 128), "e5m2", encoding)
    ref_data, ref_scale_inv = reference_quantize(x.numpy(), (1, 128), "e5m2", encoding)
    assert data.dtype == torch.float8_e5m2
    assert np.array_equal(scale_inv.numpy(), ref_scale_inv)
    assert_same_fp8(data, ref_data)


def test_bf16_input_is_quantized_from_its_exact_fp32_value():
    x = torch.randn(64, 256).bfloat16()
    data, scale_inv = quantize(x, (1, 128))
    ref_data, ref_scale_inv = reference_quantize(x.float().numpy(), (1, 128), "e4m3", "pow2")
    assert np.array_equal(scale_inv.numpy(), ref_scale_inv)
    assert_same_fp8(data, ref_data)


def test_scale_rules():
    fmax = get_format("e4m3").max
    x = torch.zeros(2, 128)
    x[1, 0] = 3.0  # 448 / 3 = 149.33 -> pow2 128
    _, s = quantize(x, (1, 128))
    assert s.tolist() == [[1.0], [1 / 128]]
    _, s = quantize(x, (1, 128), scale_encoding="fp32")
    assert s[1, 0].item() == pytest.approx(3.0 / fmax, rel=1e-6)
    # an amax that is exactly representable keeps the exact max: 448 maps to 448
    y = torch.tensor([[448.0, 1.0]])
    d, s = quantize(y, (1, -1))
    assert d.float().tolist() == [[448.0, 1.0]] and s.item() == 1.0


def test_non_finite_values_are_not_hidden():
    x = torch.randn(4, 256)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    d, s = quantize(x, (1, 128))
    rt = dequantize(d, s, (1, 128))
    assert torch.isnan(rt[0, 5]) and torch.isnan(rt[1, 7])  # E4M3 has no inf: inf becomes NaN
    assert s[0, 0] == 1.0 and s[1, 0] == 1.0  # blocks with a non-finite amax get scale 1
    assert torch.isfinite(rt[2:]).all()  # other rows are untouched
    d5, s5 = quantize(x, (1, 128), "e5m2")
    assert torch.isinf(dequantize(d5, s5, (1, 128))[1, 7])


@pytest.mark.parametrize("block", [(1, 128), (128, 128), (128, 1), (1, -1), (-1, -1)])
@pytest.mark.parametrize("encoding", ["pow2", "fp32"])
def test_round_trip_sqnr_gaussian(block, encoding):
    x = torch.randn(512, 640, generator=torch.Generator().manual_seed(0))
    d, s = quantize(x, block, scale_encoding=encoding)
    assert sqnr(x, dequantize(d, s, block)) >= 25.0


def test_blockwise_beats_tensorwise_with_outliers():
    """Why the recipe uses small tiles: one outlier costs only its own tile."""
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    x[3, 3] = 1e6  # beyond E4M3's dynamic range relative to the N(0, 1) values
    rest = torch.ones_like(x, dtype=torch.bool)
    rest[3, 3] = False
    errs = {b: sqnr(x[rest], dequantize(*quantize(x, b), b)[rest]) for b in [(1, 128), (-1, -1)]}
    assert errs[(1, 128)] >= 25 and errs[(-1, -1)] < 10


@pytest.mark.parametrize(
    ("x", "block", "fmt", "match"),
    [
        (torch.randn(4), (1, 128), "e4m3", "2-D"),
        (torch.randn(2, 3, 4), (1, 128), "e4m3", "2-D"),
        (torch.ones(4, 4, dtype=torch.int32), (1, 128), "e4m3", "floating-point"),
        (torch.randn(4, 4), (0, 128), "e4m3", "positive ints or -1"),
        (torch.randn(4, 4), (1, -2), "e4m3", "positive ints or -1"),
        (torch.randn(4, 4), (1.5, 128), "e4m3", "positive ints or -1"),
        (torch.randn(4, 4), (128,), "e4m3", "pair"),
        (torch.randn(4, 4), (1, 128), "e3m4", "unknown FP8 format"),
    ],
)
def test_bad_input_errors(x, block, fmt, match):
    with pytest.raises(ValueError, match=match):
        quantize(x, block, fmt)


def test_dequantize_checks_scale_shape():
    d, s = quantize(torch.randn(4, 256), (1, 128))
    with pytest.raises(ValueError, match="does not match"):
        dequantize(d, s, (128, 128))


def test_unknown_recipe_lists_known_ones():
    with pytest.raises(ValueError, match=r"known recipes: .*blockwise.*tensorwise"):
        get_recipe("fp4")
    assert {c.scale_encoding for c in get_recipe("blockwise_fp32scale").casts.values()} == {"fp32"}
    overridden = get_recipe("blockwise", scale_encoding="fp32")
    assert {c.scale_encoding for c in overridden.casts.values()} == {"fp32"}
    with pytest.raises(ValueError, match="no cast field scale"):  # the older keyword is gone
        get_recipe("blockwise", scale="fp32")


MX_BLOCKS = [(1, 32), (32, 1), (1, 128), (-1, -1)]


@pytest.mark.parametrize("block", MX_BLOCKS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_e8m0_scales_match_reference_bit_exact(block, shape, fmt):
    x = special_input(shape, seed=hash((block, shape, fmt)) % 1000)
    data, scale_inv = quantize(x, block, fmt, scale_encoding="e8m0")
    ref_data, ref_scale_inv = reference_quantize(x.numpy(), block, fmt, "e8m0")
    assert scale_inv.dtype == torch.float8_e8m0fnu and scale_inv.shape == ref_scale_inv.shape
    assert np.array_equal(scale_inv.float().numpy(), ref_scale_inv)
    # the stored byte is the biased exponent, by ml_dtypes' own E8M0 (an independent encoder)
    codes = ref_scale_inv.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    assert np.array_equal(scale_inv.view(torch.uint8).numpy(), codes)
    assert_same_fp8(data, ref_data)


def test_e8m0_rounds_up_so_nothing_saturates():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-30, 30, 64)[:, None]  # every magnitude
    x[3, :32] = 448 * 2.0**-5  # amax / fmax exactly a power of two: scale_inv is that power, no rounding up
    data, scale_inv = quantize(x, (1, 32), "e4m3", "e8m0")
    scale = scale_inv.float().reciprocal().repeat_interleave(32, dim=1)
    assert bool(((x * scale).abs() <= 448).all())  # the scaled block never exceeds the format's max
    assert scale_inv[3, 0].float() == 2.0**-5 and data[3, :32].float().abs().max() == 448
    block_amax = (x * scale).abs().reshape(64, 8, 32).amax(dim=2)
    assert bool((2 * block_amax > 448).all())  # and not one power of two more than needed
    assert bool((scale_inv.view(torch.uint8) != 255).all())  # never the E8M0 NaN code
    assert quantize(torch.zeros(2, 32), (1, 32), "e4m3", "e8m0")[1].float().tolist() == [[1.0], [1.0]]


class _HostSyncs(TorchDispatchMode):
    """Records the ops that would stall the host on a GPU: a tensor made from Python data
    (``torch.tensor`` / ``new_tensor``: ``lift_fresh``, a blocking host-to-device copy on CUDA) and a
    value read back to the host (``.item()``: ``_local_scalar_dense``)."""

    SYNCING = ("aten.lift_fresh", "aten._local_scalar_dense")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if str(func).startswith(self.SYNCING):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", ["blockwise", "blockwise_fp32scale", "rowwise", "tensorwise", "mxfp8"])
def test_quantize_makes_no_tensor_from_python_data(recipe):
    """Every cast of every recipe, the shard quantization of FSDP's all-gather and an emulated
    ``Fp8Linear`` step: no tensor is created from a Python number and nothing is read to the host
    (each would block a CUDA stream; ``tests/gpu`` checks the same with ``set_sync_debug_mode``)."""
    from infir2.fp8.quantize import block_amax, quantize_with_amax
    from infir2.nn import Fp8Linear
    from infir2.nn.fsdp import partial_block_amax

    x = torch.randn(300, 256) * 3
    x[0, 0], x[1, 1] = float("nan"), float("inf")
    layer = Fp8Linear(256, 384, recipe=recipe, backend="emulated")
    xi = torch.randn(2, 64, 256, requires_grad=True)
    casts = get_recipe(recipe).casts.values()
    with _HostSyncs() as mode:
        for cast in casts:
            quantize(x, cast.block, cast.fmt, cast.scale_encoding)
        amax = block_amax(x, (128, 128))
        quantize_with_amax(x[100:200], amax, (128, 128), row_offset=100, n_rows=300)
        partial_block_amax(x[100:200], 100, 300, (128, 128))
        layer(xi).sum().backward()
    assert mode.seen == [], mode.seen
