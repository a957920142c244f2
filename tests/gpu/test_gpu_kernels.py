"""The GPU fast path against the emulated reference: what the CPU suite cannot check.

Skipped below the capability each check needs (CUDA + SM89 FP8 tensor cores + Triton; the cuBLAS
block-scaled GEMM also needs SM90 and CUDA >= 12.9). On an H100/H200::

    python -m pytest tests/gpu -q

- the Triton quantization kernels (single and fused two-tiling) against ``infir2.fp8.quantize``, bit
  for bit (FP8 data with NaNs compared as NaN, and ``scale_inv``): 1x128, 128x1 and 128x128 blocks,
  pow2 and fp32 scales, E4M3 and E5M2, fp32 and bf16 inputs, partial edge blocks, zeros, outliers,
  tiny values, NaN and +-inf (the interpreter cannot check the kernel's own fp32 -> fp8 conversion);
- the block-scaled GEMMs (cuBLAS through the ``scaled_mm`` backend, Triton) against the emulated
  backend, ``calc_diff < 1e-3``, for fprop, dgrad and wgrad;
- an ``Fp8Linear`` forward + backward on each GPU backend against the emulated backend, every recipe;
- no host synchronization inside an ``Fp8Linear`` step (``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from infir2.fp8 import RECIPES, calc_diff, get_recipe, quantize
from infir2.fp8.recipe import Cast
from infir2.kernels import BACKENDS, Operand, bind, emulated
from infir2.kernels.scaled_mm import blockwise_unavailable

CUDA = torch.cuda.is_available()
SM89 = CUDA and torch.cuda.get_device_capability() >= (8, 9)
needs_triton = pytest.mark.skipif(
    not SM89 or importlib.util.find_spec("triton") is None, reason="needs an SM89+ GPU and triton"
)
needs_cublas_blockwise = pytest.mark.skipif(
    not CUDA or blockwise_unavailable(torch.device("cuda")) is not None,
    reason="needs the cuBLAS block-scaled scaled_mm (SM90, CUDA >= 12.9)",
)

QUANT_SHAPES = ((4096, 1536), (1000, 1100), (5, 130))
GEMM_SHAPES = ((8192, 1536, 1536), (8192, 256, 1536), (4096, 8960, 1536), (1000, 384, 520))


def _hard_input(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 3
    x[0, 0], x[1, 3], x[-1, -1] = float("nan"), float("inf"), float("-inf")
    x[2] = 0.0
    x[:, 5] *= 1e4
    x[-2, :40] = 1e-30
    return x.to(device="cuda", dtype=dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.float().isnan() & b.float().isnan()
    return bool(((a.view(torch.uint8) == b.view(torch.uint8)) | nan).all())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", QUANT_SHAPES)
def test_triton_quantize_is_bit_exact(dtype, shape):
    from infir2.kernels import triton_quant

    x = _hard_input(shape, dtype)
    for block in ((1, 128), (128, 1), (128, 128)):
        for encoding in ("pow2", "fp32"):
            for fmt in ("e4m3", "e5m2"):
                data, scale_inv = triton_quant.quantize(x, block, fmt, encoding)
                ref_data, ref_scale_inv = quantize(x, block, fmt, encoding)
                assert torch.equal(scale_inv, ref_scale_inv), (block, encoding, fmt)
                assert _same_bits(data, ref_data), (block, encoding, fmt)
    for encoding in ("pow2", "fp32"):  # the fused kernel: both activation tilings from one read
        pair = triton_quant.quantize_both(x, "e4m3", encoding)
        for (data, scale_inv), block in zip(pair, ((1, 128), (128, 1)), strict=True):
            ref_data, ref_scale_inv = quantize(x, block, "e4m3", encoding)
            assert torch.equal(scale_inv, ref_scale_inv) and _same_bits(data, ref_data), (block, encoding)


def _gemm_operands(m: int, n: int, k: int) -> dict[str, tuple[Operand, Operand]]:
    g = torch.Generator().manual_seed(m + n + k)
    x, w, dy = (torch.randn(s, generator=g).cuda() for s in ((m, k), (n, k), (m, n)))
    q = emulated.quantize
    wq = q(w, Cast((128, 128)))
    return {
        "fprop": (q(x, Cast((1, 128))), wq),
        "dgrad": (q(dy, Cast((1, 128))), wq.t()),
        "wgrad": (q(dy, Cast((128, 1))).t(), q(x, Cast((128, 1))).t()),
    }


@pytest.mark.parametrize(
    "backend",
    [pytest.param("scaled_mm", marks=needs_cublas_blockwise), pytest.param("triton", marks=needs_triton)],
)
@pytest.mark.parametrize("mnk", GEMM_SHAPES)
def test_block_scaled_gemms_match_emulated(backend, mnk):
    for name, (a, b) in _gemm_operands(*mnk).items():
        ref = emulated.gemm_nt(a, b, torch.float32)
        gemm = BACKENDS[backend]
        if not gemm.supports_gemm(a, b, torch.float32):
            assert backend == "scaled_mm", (name, mnk)  # cuBLAS needs K % 128, M and N % 16; Triton takes all
            continue
        for out_dtype in (torch.float32, torch.bfloat16):
            diff = calc_diff(gemm.gemm_nt(a, b, out_dtype).float(), ref)
            assert diff < 1e-3, (name, out_dtype, diff)


@pytest.mark.skipif(not SM89, reason="needs an SM89+ GPU")
@pytest.mark.parametrize("recipe", [r for r in RECIPES if RECIPES[r].enabled])
def test_fp8_linear_on_gpu_matches_emulated_and_never_syncs(recipe):
    from infir2.nn import Fp8Linear, cache_fp8_weights

    torch.manual_seed(0)
    b, s, k, n = 4, 2048, 1536, 8960
    x = torch.randn(b, s, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(b, s, n, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for backend in ["emulated", *[name for name in ("scaled_mm", "triton") if _usable(name, recipe)]]:
        layer = Fp8Linear(
            k, n, bias=False, device="cuda", dtype=torch.bfloat16, recipe=recipe, backend=backend
        )
        torch.manual_seed(1)
        torch.nn.init.normal_(layer.weight, std=0.02)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        outs[backend] = (y, xi.grad, layer.weight.grad)
        if backend == "emulated":
            continue
        diffs = [
            calc_diff(a.float(), c.float()) for a, c in zip(outs["emulated"], outs[backend], strict=True)
        ]
        assert max(diffs) < 1e-3, (backend, diffs)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # a host sync inside the step raises
        try:
            with cache_fp8_weights(layer):
                layer(xi).backward(dy)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _usable(backend: str, recipe: str) -> bool:
    return BACKENDS[backend].why_unavailable(get_recipe(recipe), torch.device("cuda")) is None


def test_the_gpu_tests_are_collected_everywhere():
    """This file imports and collects on a CPU machine (its tests skip there): CI keeps it importable."""
    assert bind(get_recipe("blockwise"), "cpu").name == "fast_emulated"
