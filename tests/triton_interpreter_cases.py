"""Triton kernels run on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``).

Run by ``test_kernels_triton.py`` in a fresh process with ``TRITON_INTERPRET=1`` set before Triton is
imported (the interpreter is chosen when ``@triton.jit`` runs, and torchao imports Triton early in
the main test process); by hand: ``TRITON_INTERPRET=1 pytest tests/triton_interpreter_cases.py``.

What is checked here, against the plain-torch reference (``infir2.fp8.quantize``, ``emulated.gemm_nt``):

* quantize, for (1,128), (128,1) with the transposed GEMM layout, and (128,128) blocks; pow2 and fp32
  scales; E4M3 and E5M2; partial edge blocks, zero blocks, outliers, tiny values, NaN and +-inf:
  - ``scale_inv`` bit for bit;
  - the scaled, saturated fp32 values just before the FP8 cast, bit for bit (the kernel writes them
    as fp32 when asked), NaN where the reference has NaN;
  - torch's FP8 cast of those values equals the reference's FP8 data bit for bit.
* the block-scaled GEMM for the three GEMMs of the recipe (fprop, dgrad, wgrad) by ``calc_diff``.
* an ``Fp8Linear`` forward/backward through the ``triton`` backend against the emulated backend.

What stays unchecked on CPU: the single ``fp32 -> fp8`` conversion instruction inside the quantize
kernel. The interpreter emulates it with bit manipulation that does not round correctly when the
mantissa carries into the exponent (126.25 * 2 becomes 64, not 128 in E4M3) and turns NaN into a
finite value, so the kernel's own FP8 output is not compared here. On a GPU that conversion is the
hardware ``cvt.rn.satfinite`` (round to nearest even, like torch's cast); ``tests/gpu/``
checks the FP8 output bit for bit there. The tensor-core path of ``tl.dot`` and the cuBLAS block-scaled
``scaled_mm`` call also need a GPU (the layouts it is given are checked in ``test_kernels_scaled_mm.py``).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch

from infir2.fp8 import calc_diff, get_recipe, sqnr
from infir2.fp8.formats import get_format
from infir2.fp8.quantize import amax_to_scale, expand_blocks, quantize
from infir2.fp8.recipe import Cast
from infir2.kernels import BACKENDS, Operand, emulated

pytest.importorskip("triton", reason="triton is not installed (the test extra: pip install -e '.[test]')")

BLOCKS = [(1, 128), (128, 1), (128, 128)]


if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "needs TRITON_INTERPRET=1 before triton is imported (see test_kernels_triton.py)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def tq() -> ModuleType:
    return importlib.import_module("infir2.kernels.triton_quant")


@pytest.fixture(scope="module")
def tg() -> ModuleType:
    return importlib.import_module("infir2.kernels.triton_gemm")


def _hard_input(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Gaussian data with outliers, tiny values, a zero block-row, NaN and +-inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    m, k = shape
    x[0, 0] = float("nan")
    x[min(3, m - 1), min(5, k - 1)] = float("inf")
    x[m - 1, k - 1] = float("-inf")
    x[min(2, m - 1)] = 0.0  # a zero row: zero 1x128 blocks
    x[:, min(7, k - 1)] *= 1e4  # an outlier channel
    x[m // 2, : k // 2] = 1e-30  # tiny values
    return x


def _reference_precast(x: torch.Tensor, block: tuple[int, int], fmt: str, encoding: str) -> torch.Tensor:
    """The reference's scaled, saturated fp32 values right before its FP8 cast (same steps as
    ``infir2.fp8.quantize``), shape of ``x``."""
    f = get_format(fmt)
    blocks = expand_blocks(x.float(), block)
    scale = amax_to_scale(blocks.abs().amax(dim=(1, 3)), f, encoding)
    y = blocks * scale[:, None, :, None]
    clamped = y.clamp(-f.max, f.max)
    y = torch.where(torch.isinf(y), y if f.has_inf else torch.full_like(y, float("nan")), clamped)
    m, k = x.shape
    return y.reshape(blocks.shape[0] * blocks.shape[1], -1)[:m, :k]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """FP8 tensors equal bit for bit, NaNs of either sign counted equal."""
    nan = a.float().isnan() & b.float().isnan()
    return bool(((a.view(torch.uint8) == b.view(torch.uint8)) | nan).all())


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("encoding", ["pow2", "fp32"])
@pytest.mark.parametrize("shape", [(130, 260), (5, 130)])
def test_quantize_matches_reference(tq, block, encoding, shape):
    x = _hard_input(shape, seed=sum(shape) + 7 * block[0] + (encoding == "pow2"))
    for fmt in ("e4m3", "e5m2") if encoding == "pow2" else ("e4m3",):
        ref_data, ref_scale_inv = quantize(x, block, fmt, encoding)
        data, scale_inv = tq._quantize(x, block, fmt, encoding, data_dtype=torch.float32)
        assert scale_inv.shape == ref_scale_inv.shape
        assert torch.equal(scale_inv, ref_scale_inv), f"scale_inv differs for {fmt}"
        torch.testing.assert_close(
            data, _reference_precast(x, block, fmt, encoding), rtol=0, atol=0, equal_nan=True
        )
        assert _same_bits(data.to(get_format(fmt).dtype), ref_data)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_low_precision_input_and_strided_input(tq, dtype):
    x = torch.randn(130, 256).to(dtype)
    for block in BLOCKS:
        ref_data, ref_scale_inv = quantize(x, block)
        data, scale_inv = tq._quantize(x, block, "e4m3", "pow2", data_dtype=torch.float32)
        assert torch.equal(scale_inv, ref_scale_inv)
        assert _same_bits(data.to(torch.float8_e4m3fn), ref_data)
    xt = torch.randn(256, 20).t()  # a transposed view: the kernel reads through the strides
    data, scale_inv = tq._quantize(xt, (1, 128), "e4m3", "pow2", data_dtype=torch.float32)
    assert torch.equal(scale_inv, quantize(xt, (1, 128))[1])
    assert _same_bits(data.to(torch.float8_e4m3fn), quantize(xt, (1, 128))[0])


@pytest.mark.parametrize("encoding", ["pow2", "fp32"])
@pytest.mark.parametrize("shape", [(130, 260), (5, 130)])
def test_quantize_both_equals_two_quantizations(tq, encoding, shape):
    """The fused kernel (one read, 1x128 and 128x1 outputs) gives the reference's values and layouts."""
    x = _hard_input(shape, seed=sum(shape) + (encoding == "pow2"))
    for fmt in ("e4m3", "e5m2") if encoding == "pow2" else ("e4m3",):
        pair = tq._quantize_both(x, fmt, encoding, data_dtype=torch.float32)
        for (data, scale_inv), block in zip(pair, [(1, 128), (128, 1)], strict=True):
            ref_data, ref_scale_inv = quantize(x, block, fmt, encoding)
            assert torch.equal(scale_inv, ref_scale_inv), (fmt, block)
            precast = _reference_precast(x, block, fmt, encoding)
            torch.testing.assert_close(data, precast, rtol=0, atol=0, equal_nan=True)
            assert _same_bits(data.to(get_format(fmt).dtype), ref_data)
            single = tq.quantize(x, block, fmt, encoding)  # same layouts as the single kernel
            assert data.stride() == single[0].stride() and scale_inv.stride() == single[1].stride()


def test_quantize_layouts_are_the_gemm_layouts(tq):
    x = torch.randn(256, 384)
    data, scale_inv = tq.quantize(x, (128, 1))
    assert data.shape == (256, 384) and data.t().is_contiguous()  # physically [K, M]: tokens fastest
    assert data.dtype == torch.float8_e4m3fn and scale_inv.is_contiguous()
    data, scale_inv = tq.quantize(x, (1, 128))
    assert data.is_contiguous() and scale_inv.shape == (256, 3) and scale_inv.stride() == (1, 256)
    data, scale_inv = tq.quantize(x, (128, 128))
    assert data.is_contiguous() and scale_inv.shape == (2, 3) and scale_inv.is_contiguous()


def test_quantize_rejects_what_it_does_not_implement(tq):
    assert not tq.supports_block((1, -1), (4, 256))
    with pytest.raises(ValueError, match="triton quantize takes blocks"):
        tq.quantize(torch.randn(4, 256), (1, -1))
    with pytest.raises(ValueError, match="2-D floating-point"):
        tq.quantize(torch.randn(4, 4, 4), (1, 128))
    data, scale_inv = tq.quantize(torch.empty(0, 256), (1, 128))
    assert data.shape == (0, 256) and scale_inv.shape == (0, 2)


def _operands(m: int, n: int, k: int, seed: int) -> dict[str, tuple[Operand, Operand]]:
    g = torch.Generator().manual_seed(seed)
    x, w, dy = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(m, n, generator=g)
    q = emulated.quantize
    wq = q(w, Cast((128, 128)))
    return {
        "fprop": (q(x, Cast((1, 128))), wq),  # [T,K] @ [K,N]
        "dgrad": (q(dy, Cast((1, 128))), wq.t()),  # [T,N] @ [N,K]
        "wgrad": (q(dy, Cast((128, 1))).t(), q(x, Cast((128, 1))).t()),  # [N,T] @ [T,K]
    }


@pytest.mark.parametrize(
    ("mnk", "out_dtype"),
    [((128, 128, 256), torch.float32), ((130, 136, 260), torch.float32), ((7, 130, 129), torch.bfloat16)],
)
def test_gemm_matches_emulated(tg, mnk, out_dtype):
    for name, (a, b) in _operands(*mnk, seed=sum(mnk)).items():
        assert tg.supports_operands(a, b), name
        out = tg.gemm_nt(a, b, out_dtype)
        ref = emulated.gemm_nt(a, b, torch.float32)
        assert out.dtype == out_dtype and out.shape == ref.shape
        assert calc_diff(out.float(), ref) < 1e-3, name
        if out_dtype == torch.float32:  # same products, fp32 sums in another order
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4 * float(ref.abs().max()))


def test_gemm_declines_other_blocks(tg):
    a = emulated.quantize(torch.randn(4, 256), Cast((1, -1)))
    assert not tg.supports_operands(a, a)
    with pytest.raises(ValueError, match="takes"):
        tg.gemm_nt(a, a, torch.float32)


def test_fp8_linear_through_triton_backend(tq, tg):
    """The whole autograd function (3 GEMMs; X and dY through the fused two-tiling kernel, W through the
    single one) through the Triton kernels on CPU.

    The backend here is the ``triton`` backend except that the quantize kernel's fp32 pre-cast values
    are cast to FP8 by torch (the interpreter's own cast misrounds, see the module doc), so the only
    difference from the emulated backend left is the order of the fp32 sums in the GEMM."""
    from types import SimpleNamespace

    from infir2.kernels import Kernels
    from infir2.nn.linear import _Fp8LinearFunction

    def quantize_via_kernel(x: torch.Tensor, cast: Cast) -> Operand:
        data, scale_inv = tq._quantize(x, cast.block, cast.fmt, cast.scale_encoding, data_dtype=torch.float32)
        return Operand(data.to(get_format(cast.fmt).dtype), scale_inv, cast.block)

    def pair_via_kernel(x: torch.Tensor, a: Cast, b: Cast) -> tuple[Operand, Operand]:
        assert (tuple(a.block), tuple(b.block)) == ((1, 128), (128, 1))
        row, col = tq._quantize_both(x, a.fmt, a.scale_encoding, data_dtype=torch.float32)
        dtype = get_format(a.fmt).dtype
        return Operand(row[0].to(dtype), row[1], (1, 128)), Operand(col[0].to(dtype), col[1], (128, 1))

    interpreted = SimpleNamespace(
        NAME="triton-interpreted",
        supports_quantize=lambda x, cast: True,
        quantize=quantize_via_kernel,
        quantize_pair=pair_via_kernel,
        supports_gemm=lambda a, b, out_dtype: tg.supports_operands(a, b),
        gemm_nt=tg.gemm_nt,
    )
    recipe = get_recipe("blockwise")
    backends = {
        "emulated": Kernels(recipe, torch.device("cpu"), (BACKENDS["emulated"],)),
        "triton": Kernels(recipe, torch.device("cpu"), (interpreted,)),  # type: ignore[arg-type]
    }
    torch.manual_seed(0)
    x = torch.randn(136, 256, requires_grad=True)
    w = torch.randn(384, 256, requires_grad=True)
    dy = torch.randn(136, 384)
    outs = {}
    for name, backend in backends.items():
        x.grad = w.grad = None
        w_fprop = backend.quantize(w.detach(), recipe.w)
        y = _Fp8LinearFunction.apply(x, w, None, recipe, backend, w_fprop)
        y.backward(dy)
        outs[name] = (y.detach(), x.grad.clone(), w.grad.clone())
    for ref, got in zip(outs["emulated"], outs["triton"], strict=True):
        assert calc_diff(got, ref) < 1e-6 and sqnr(ref, got) > 100


def _special_positions(precast: torch.Tensor, fmt: str) -> torch.Tensor:
    """Where the pre-cast value is +-inf, NaN, +-max or 0: bytes the interpreter's cast cannot misround."""
    return precast.isinf() | precast.isnan() | (precast.abs() == get_format(fmt).max) | (precast == 0)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_bytes_of_special_values(tq, fmt):
    """The kernel's own FP8 output (the interpreter's cast, then the explicit selects) has the reference's
    bytes for inf, NaN, saturated and zero values: E5M2 keeps +-inf as 0x7C / 0xFC (the GPU cast would
    give +-max), E4M3 turns inf into NaN."""
    x = _hard_input((130, 260), seed=3)
    x[4, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    x[6, 200] = 1e38  # a huge finite value: its block's amax
    for block in BLOCKS:
        ref_data, _ = quantize(x, block, fmt, "pow2")
        data, _ = tq.quantize(x, block, fmt, "pow2")
        where = _special_positions(_reference_precast(x, block, fmt, "pow2"), fmt)
        assert int(where.sum()) > 100, block  # zeros, the saturated outlier channel, the specials
        assert _same_bits(data[where], ref_data[where]), (block, fmt)
        if fmt == "e5m2":
            ref_inf = ref_data.float().isinf()
            assert ref_inf.any() and bool((data.view(torch.uint8)[ref_inf] & 0x7F == 0x7C).all())
    pair = tq.quantize_both(x, fmt, "pow2")
    for (data, _), block in zip(pair, [(1, 128), (128, 1)], strict=True):
        ref_data, _ = quantize(x, block, fmt, "pow2")
        where = _special_positions(_reference_precast(x, block, fmt, "pow2"), fmt)
        assert _same_bits(data[where], ref_data[where]), ("fused", block, fmt)


def _far_apart_rows(rows: int, cols: int, row_stride: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``[rows, cols]`` view whose last row starts ``(rows - 1) * row_stride`` elements in: offsets past
    2**31 without 2**31 elements in memory (the storage is allocated, never touched but for these rows)."""
    storage = torch.empty((rows - 1) * row_stride + cols, dtype=dtype)
    view = storage.as_strided((rows, cols), (row_stride, 1))
    g = torch.Generator().manual_seed(rows)
    view.copy_((torch.randn(rows, cols, generator=g) * 3).to(dtype))
    return view


def test_offsets_past_int32_quantize(tq):
    """Element offsets of 2**31 and more (row 2 at 2 * 2**30): int32 offsets would wrap to a negative
    address; the kernels widen them and read the right rows."""
    x = _far_apart_rows(3, 256, 2**30, torch.bfloat16)
    dense = x.contiguous()
    for block in BLOCKS:
        data, scale_inv = tq._quantize(x, block, "e4m3", "pow2", data_dtype=torch.float32)
        assert torch.equal(scale_inv, quantize(dense, block)[1]), block
        torch.testing.assert_close(data, _reference_precast(dense, block, "e4m3", "pow2"), rtol=0, atol=0)
    row, col = tq._quantize_both(x, "e4m3", "pow2", data_dtype=torch.float32)
    assert torch.equal(row[1], quantize(dense, (1, 128))[1])
    assert torch.equal(col[1], quantize(dense, (128, 1))[1])
    torch.testing.assert_close(row[0], _reference_precast(dense, (1, 128), "e4m3", "pow2"), rtol=0, atol=0)


def test_offsets_past_int32_gemm(tg):
    """The GEMM reads A rows 2**31 bytes apart (a strided FP8 view) and matches the emulated GEMM."""
    codes = _far_apart_rows(3, 256, 2**30, torch.float32).to(torch.float8_e4m3fn)
    a_data = torch.empty(2 * 2**30 + 256, dtype=torch.float8_e4m3fn).as_strided((3, 256), (2**30, 1))
    a_data.copy_(codes)
    a = Operand(a_data, torch.rand(3, 2) + 0.5, (1, 128))
    b = emulated.quantize(torch.randn(136, 256), Cast((128, 128)))
    dense = Operand(a_data.contiguous(), a.scale_inv, (1, 128))
    out = tg.gemm_nt(a, b, torch.float32)
    torch.testing.assert_close(out, emulated.gemm_nt(dense, b, torch.float32), rtol=1e-5, atol=1e-4)


def test_launches_enter_the_tensors_device(tq, tg, monkeypatch):
    """Each launch runs inside ``launch_guard`` of its tensor, which enters that tensor's CUDA device."""
    entered = []

    class Recorder:
        def __init__(self, device):
            entered.append(torch.device(device))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", Recorder)
    from types import SimpleNamespace

    with tq.launch_guard(SimpleNamespace(device=torch.device("cuda", 1))):  # type: ignore[arg-type]
        pass
    assert entered == [torch.device("cuda", 1)]
    guarded = []
    real_guard = tq.launch_guard
    monkeypatch.setattr(tq, "launch_guard", lambda t: guarded.append(t.device) or real_guard(t))
    monkeypatch.setattr(tg, "launch_guard", lambda t: guarded.append(t.device) or real_guard(t))
    x = torch.randn(128, 256)
    tq.quantize(x, (1, 128))
    tq.quantize_both(x)
    ops = emulated.quantize(x, Cast((1, 128))), emulated.quantize(x, Cast((128, 128)))
    tg.gemm_nt(*ops, torch.float32)
    assert guarded == [torch.device("cpu")] * 3 and len(entered) == 1  # CPU tensors: no CUDA device entered


def test_pipeline_stages_follow_shared_memory(tg):
    assert tg.stages_for(232448) == 3  # H100 / H200: 227 KiB per block
    assert tg.stages_for(101376) == 2  # Ada (SM89): 99 KiB, 3 stages of 32 KiB would not fit
    assert tg.stages_for(49152) == 1
    assert tg.num_stages(torch.device("cpu")) == 3


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_nan_is_the_byte_0x7f_on_both_paths(tq, fmt):
    """NaN of either sign, NaN payloads and (E4M3) infinities: the kernel and the reference write the one
    byte ``NAN_CODE`` (0x7F), and every special value has the same byte on both paths, no NaN leniency."""
    from infir2.fp8.formats import NAN_CODE

    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(11))
    # +NaN, -NaN, NaNs with payloads (signalling, all bits set), as fp32 bit patterns
    nans = torch.tensor([0x7FC00000, -0x400000, 0x7F800001, -1], dtype=torch.int32).view(torch.float32)
    x[0, :8] = torch.cat([nans, torch.tensor([float("inf"), float("-inf"), 0.0, -0.0])])
    x[2, 130:140] = float("inf")  # a run: an E4M3 infinity becomes NaN (inf - inf on the CPU: negative)
    for block in BLOCKS:
        ref_data, _ = quantize(x, block, fmt, "pow2")
        data, _ = tq.quantize(x, block, fmt, "pow2")
        where = _special_positions(_reference_precast(x, block, fmt, "pow2"), fmt)
        ref_bytes, bytes_ = ref_data.view(torch.uint8), data.view(torch.uint8)
        assert torch.equal(bytes_[where], ref_bytes[where]), (block, fmt)
        nan = ref_data.float().isnan()
        assert int(nan.sum()) >= 4 and bool((ref_bytes[nan] == NAN_CODE).all()), (block, fmt)
        assert bool((bytes_[nan] == NAN_CODE).all()), (block, fmt)


@pytest.mark.parametrize(("rows", "offset"), [(100, 0), (100, 100), (37, 263), (0, 50)])
def test_quantize_with_scale_is_the_shard_quantization_of_fsdp(tq, rows, offset):
    """Rows ``offset ..`` of a ``[300, 260]`` weight with its 128x128 block scales (blocks straddle the
    shard's edges): the values before the cast equal the reference's, and their FP8 bytes its codes."""
    from infir2.fp8.quantize import block_amax, quantize_with_amax

    x = _hard_input((300, 260), seed=rows + offset)
    amax = block_amax(x, (128, 128))
    shard = x[offset : offset + rows]
    for fmt in ("e4m3", "e5m2"):
        ref_data, ref_scale_inv = quantize_with_amax(
            shard, amax, (128, 128), fmt, row_offset=offset, n_rows=300
        )
        scale = amax_to_scale(amax, get_format(fmt), "pow2")
        precast = tq._quantize_with_scale(shard, scale, (128, 128), fmt, offset, data_dtype=torch.float32)
        assert precast.shape == shard.shape and torch.equal(scale.reciprocal(), ref_scale_inv)
        if rows:
            full = _reference_precast(x, (128, 128), fmt, "pow2")[offset : offset + rows]
            torch.testing.assert_close(precast, full, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(precast.to(get_format(fmt).dtype).view(torch.uint8), ref_data.view(torch.uint8)), (
            fmt
        )


def test_fsdp_quantizes_its_shard_with_the_triton_kernel_where_it_runs(tq, monkeypatch):
    """``fsdp_pre_all_gather``'s quantization goes to the Triton kernel when the backend takes the shard
    (a GPU: faked here), and gives the reference's codes and scales."""
    from infir2.fp8.quantize import block_amax, quantize_with_amax
    from infir2.kernels import triton_backend
    from infir2.nn import fsdp

    calls = []

    def kernel(x, scale, block, fmt, row_offset):  # the interpreter's own FP8 cast misrounds: torch casts
        calls.append(row_offset)
        return tq._quantize_with_scale(x, scale, block, fmt, row_offset, torch.float32).to(
            get_format(fmt).dtype
        )

    monkeypatch.setattr(tq, "quantize_with_scale", kernel)
    x = _hard_input((300, 260), seed=1)
    amax, shard, cast = block_amax(x, (128, 128)), x[150:300], Cast((128, 128))
    ref_data, ref_scale_inv = quantize_with_amax(shard, amax, (128, 128), row_offset=150, n_rows=300)
    assert not triton_backend.takes_shard(shard, cast)  # a CPU tensor: the reference runs
    fsdp._quantize_shard(shard, amax, cast, 150, 300)
    assert calls == []
    monkeypatch.setattr(triton_backend, "takes_shard", lambda x, cast: True)
    data, scale_inv = fsdp._quantize_shard(shard, amax, cast, 150, 300)
    assert calls == [150] and torch.equal(scale_inv, ref_scale_inv)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
