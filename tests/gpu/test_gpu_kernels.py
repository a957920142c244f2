"""The GPU fast path against the emulated reference: what the CPU suite cannot check.

Skipped below the capability each check needs (CUDA + SM89 FP8 tensor cores + Triton; the cuBLAS
block-scaled GEMM also needs SM90 and CUDA >= 12.9). On an H100/H200::

    python -m pytest tests/gpu -q

- the Triton quantization kernels (single and fused two-tiling) against ``infir2.fp8.quantize``, bit
  for bit (FP8 bytes, every NaN as 0x7F, and ``scale_inv``): 1x128, 128x1 and 128x128 blocks,
  pow2 and fp32 scales, E4M3 and E5M2, fp32 and bf16 inputs, partial edge blocks, zeros, outliers,
  tiny values, NaN and +-inf (the interpreter cannot check the kernel's own fp32 -> fp8 conversion);
- the block-scaled GEMMs (cuBLAS through the ``scaled_mm`` backend, Triton) against the emulated
  backend, ``calc_diff < 1e-3``, for fprop, dgrad and wgrad;
- an ``Fp8Linear`` forward + backward on each GPU backend against the emulated backend, every recipe;
- no host synchronization inside an ``Fp8Linear`` step (``torch.cuda.set_sync_debug_mode("error")``);
- the FP8 bytes of every special value (E5M2 +-inf as 0x7C / 0xFC: the GPU cast alone saturates it);
- offsets past 2**31: a ``[131072, 18944]`` bf16 quantize and a GEMM whose output has 2.5e9
  elements, their last blocks against the reference;
- a layer on ``cuda:1`` while the current device is 0 (skipped with one GPU);
- the K-major transposed weight of dgrad (``cache_fp8_weights``) gives the view's gradients, and the
  ``layer`` scope (K-major copy made in backward) the step cache's bit for bit;
- the FSDP2 shard quantizer (``triton_quant.quantize_with_scale``) bit for bit against the reference;
- token counts that are not a multiple of 128 stay on cuBLAS (padded inside the layer);
- a world-size-1 NCCL FSDP2 run (FP8 all-gather, fused AdamW) under ``TORCH_CUDA_SANITIZER=1``
  (``fsdp_sanitizer_worker.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

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
    """The same bytes, NaNs included: every backend writes a NaN as ``NAN_CODE`` (0x7F)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


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


SPECIALS = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0]


@needs_triton
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_special_values_have_the_reference_bytes(fmt):
    """Each special value alone in its block and beside ordinary values, every block shape, both scale
    rules; the E5M2 infinities must come out as 0x7C / 0xFC, not +-57344 (0x7B / 0xFB)."""
    from infir2.kernels import triton_quant

    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(5))
    for i, v in enumerate(SPECIALS):
        x[i, 0] = v  # beside ordinary values in its 1x128 block
        x[128 + i, 128 + 10 * i : 138 + 10 * i] = v  # a run of it
    x = x.cuda()
    for block in ((1, 128), (128, 1), (128, 128)):
        for encoding in ("pow2", "fp32"):
            data, scale_inv = triton_quant.quantize(x, block, fmt, encoding)
            ref_data, ref_scale_inv = quantize(x, block, fmt, encoding)
            assert torch.equal(scale_inv, ref_scale_inv), (block, encoding)
            assert _same_bits(data, ref_data), (block, encoding)
            if fmt == "e5m2":
                codes = data.view(torch.uint8)[x.isinf()]
                assert set(codes.tolist()) <= {0x7C, 0xFC} and len(codes), (block, encoding)
    for (data, _), block in zip(triton_quant.quantize_both(x, fmt), ((1, 128), (128, 1)), strict=True):
        assert _same_bits(data, quantize(x, block, fmt)[0]), ("fused", block)


def _bits_of_last_block(data: torch.Tensor, ref: torch.Tensor) -> bool:
    return _same_bits(data[-128:, -128:], ref)


@needs_triton
def test_quantize_past_int32_offsets():
    """``[131072, 18944]`` bf16 (2.48e9 elements, Qwen2.5-7B's MLP at 128k tokens): the last 128x128
    corner of every output equals the reference quantization of that corner (blocks are aligned)."""
    from infir2.kernels import triton_quant

    x = torch.randn(131072, 18944, device="cuda", dtype=torch.bfloat16)
    corner = x[-128:, -128:].clone()
    for block in ((1, 128), (128, 1), (128, 128)):
        data, scale_inv = triton_quant.quantize(x, block)
        ref_data, ref_scale_inv = quantize(corner, block)
        assert _bits_of_last_block(data, ref_data), block
        rows, cols = ref_scale_inv.shape
        assert torch.equal(scale_inv[-rows:, -cols:], ref_scale_inv), block
        del data, scale_inv
    (row, _), (col, _) = triton_quant.quantize_both(x)
    assert _bits_of_last_block(row, quantize(corner, (1, 128))[0])
    assert _bits_of_last_block(col, quantize(corner, (128, 1))[0])


@pytest.mark.parametrize(
    "backend",
    [pytest.param("scaled_mm", marks=needs_cublas_blockwise), pytest.param("triton", marks=needs_triton)],
)
def test_gemm_output_past_int32_offsets(backend):
    """fprop ``[131072, 3584] @ [18944, 3584].T``: a 2.48e9-element output; its last tile against the
    emulated GEMM of the last rows and columns."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(131072, 3584, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(18944, 3584, device="cuda", generator=g)
    a, b = emulated.quantize(x, Cast((1, 128))), emulated.quantize(w, Cast((128, 128)))
    del x
    out = BACKENDS[backend].gemm_nt(a, b, torch.bfloat16)
    a_tail = Operand(a.data[-128:], a.scale_inv[-128:], a.block)
    b_tail = Operand(b.data[-128:], b.scale_inv[-1:], b.block)
    ref = emulated.gemm_nt(a_tail, b_tail, torch.float32)
    assert calc_diff(out[-128:, -128:].float(), ref) < 1e-3


@pytest.mark.skipif(not SM89 or torch.cuda.device_count() < 2, reason="needs two SM89+ GPUs")
@pytest.mark.parametrize("backend", ["triton", "scaled_mm"])
def test_layer_on_the_second_gpu(backend):
    """A layer on cuda:1 while the current device is cuda:0: the kernels launch on the tensors' device."""
    from infir2.nn import Fp8Linear

    if not _usable(backend, "blockwise"):
        pytest.skip(f"{backend} cannot run blockwise here")
    torch.cuda.set_device(0)
    outs = {}
    for name in ("emulated", backend):
        torch.manual_seed(0)
        layer = Fp8Linear(1536, 1024, bias=False, device="cuda:1", backend=name)
        x = torch.randn(512, 1536, device="cuda:1", requires_grad=True)
        y = layer(x)
        y.float().sum().backward()
        outs[name] = (y, x.grad, layer.weight.grad)
    assert torch.cuda.current_device() == 0
    for ref, got in zip(outs["emulated"], outs[backend], strict=True):
        assert calc_diff(got.float(), ref.float()) < 1e-3


@pytest.mark.skipif(not SM89, reason="needs an SM89+ GPU")
@pytest.mark.parametrize("backend", ["scaled_mm", "triton"])
def test_k_major_dgrad_weight_gives_the_views_gradients(backend):
    from infir2.nn import Fp8Linear, cache_fp8_weights

    if not _usable(backend, "blockwise"):
        pytest.skip(f"{backend} cannot run blockwise here")
    torch.manual_seed(0)
    layer = Fp8Linear(1536, 8960, bias=False, device="cuda", dtype=torch.bfloat16, backend=backend)
    x = torch.randn(4096, 1536, device="cuda", dtype=torch.bfloat16)
    grads = []
    for cached in (False, True):
        xi = x.clone().requires_grad_()
        if cached:
            with cache_fp8_weights(layer):
                layer(xi).float().sum().backward()
                entry = layer._weight_cache.get("weight")
                assert entry is not None and entry[1][1] is not None  # (forward weight, K-major dgrad copy)
        else:
            layer(xi).float().sum().backward()
        grads.append(xi.grad)
    assert calc_diff(grads[0].float(), grads[1].float()) < 1e-6  # same products; sums may reorder


@pytest.mark.skipif(not SM89, reason="needs an SM89+ GPU")
@pytest.mark.parametrize("backend", ["scaled_mm", "triton"])
def test_layer_scope_gives_the_step_caches_gradients_bit_for_bit(backend):
    """``fp8.weight_cache: layer`` keeps no cache: backward makes the K-major dgrad copy from the saved
    forward copy, so the dgrad GEMM reads the bytes, in the layout, of the step cache's copy."""
    from infir2.nn import Fp8Linear, cache_fp8_weights

    if not _usable(backend, "blockwise"):
        pytest.skip(f"{backend} cannot run blockwise here")
    torch.manual_seed(0)
    layer = Fp8Linear(1536, 8960, bias=False, device="cuda", dtype=torch.bfloat16, backend=backend)
    x = torch.randn(4096, 1536, device="cuda", dtype=torch.bfloat16)
    grads = {}
    for scope in ("step", "layer"):
        xi = x.clone().requires_grad_()
        layer.weight.grad = None
        with cache_fp8_weights(layer, scope):
            for _ in range(2):  # two micro-batches
                layer(xi).float().sum().backward()
            assert bool(layer._weight_cache) == (scope == "step")
        grads[scope] = (xi.grad, layer.weight.grad)
    for a, b in zip(grads["step"], grads["layer"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not CUDA or not torch.distributed.is_nccl_available(), reason="needs CUDA and NCCL")
def test_fsdp_fp8_gather_under_the_cuda_sanitizer(tmp_path):
    here = Path(__file__).resolve().parent
    src = here.parents[1] / "src"
    env = {
        **os.environ,
        "TORCH_CUDA_SANITIZER": "1",
        "PYTHONPATH": f"{src}{os.pathsep}{here}",
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
    }
    out = tmp_path / "fsdp.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        str(here / "fsdp_sanitizer_worker.py"),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["adamw_max_error"] < 1e-6, result
    assert result["fp8_weights_exact"] == result["fp8_weights"], result


def test_the_gpu_tests_are_collected_everywhere():
    """This file imports and collects on a CPU machine (its tests skip there): CI keeps it importable."""
    assert bind(get_recipe("blockwise"), "cpu").name == "fast_emulated"


@needs_triton
@pytest.mark.parametrize(("rows", "offset"), [(4480, 0), (4480, 4480), (1000, 333)])
def test_fsdp_shard_kernel_is_bit_exact(rows, offset):
    """The Triton shard quantizer of FSDP2's FP8 all-gather (``quantize_with_scale``) against
    ``quantize_with_amax``: rows of an ``[8960, 1536]`` weight whose 128x128 blocks straddle the shard."""
    from infir2.fp8.quantize import block_amax, quantize_with_amax
    from infir2.kernels import triton_backend

    x = _hard_input((8960, 1536), torch.float32)
    amax = block_amax(x, (128, 128))
    shard = x[offset : offset + rows]
    assert triton_backend.takes_shard(shard, Cast((128, 128)))
    for fmt in ("e4m3", "e5m2"):
        data, scale_inv = triton_backend.quantize_with_amax(shard, amax, Cast((128, 128), fmt), offset)
        ref_data, ref_scale_inv = quantize_with_amax(
            shard, amax, (128, 128), fmt, row_offset=offset, n_rows=8960
        )
        assert torch.equal(scale_inv, ref_scale_inv) and _same_bits(data, ref_data), fmt


@pytest.mark.parametrize("tokens", [1000, 8191])
def test_token_counts_off_the_block_stay_on_cublas(tokens, monkeypatch):
    """A token count that is not a multiple of 128 is padded inside the layer: every GEMM runs on cuBLAS
    (none reaches the Triton or emulated GEMM) and the results are the emulated ones."""
    from infir2.nn import Fp8Linear

    if (
        not CUDA
        or blockwise_unavailable(torch.device("cuda")) is not None
        or not _usable("triton", "blockwise")
    ):
        pytest.skip("needs the cuBLAS block-scaled scaled_mm and the Triton quantizer")
    outs = {}
    for backend in ("emulated", "scaled_mm"):
        torch.manual_seed(0)
        layer = Fp8Linear(1536, 1024, bias=False, device="cuda", dtype=torch.bfloat16, backend=backend)
        x = torch.randn(tokens, 1536, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        elsewhere: list[str] = []
        if backend == "scaled_mm":
            for name in ("triton", "emulated"):
                real = BACKENDS[name].gemm_nt
                monkeypatch.setattr(
                    BACKENDS[name],
                    "gemm_nt",
                    lambda a, b, d, real=real, name=name, seen=elsewhere: seen.append(name) or real(a, b, d),
                )
        y = layer(x)
        y.float().sum().backward()
        assert elsewhere == [], elsewhere
        outs[backend] = (y, x.grad, layer.weight.grad)
        monkeypatch.undo()
    for ref, got in zip(outs["emulated"], outs["scaled_mm"], strict=True):
        assert calc_diff(got.float(), ref.float()) < 1e-3
