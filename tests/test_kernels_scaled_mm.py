"""The cuBLAS block-scaled ``scaled_mm`` path and the GPU backends' gating, checked without a GPU.

The GEMM itself needs an SM90 GPU with CUDA >= 12.9 (``benchmarks/gpu_bench.py`` checks it against
the emulated backend there); here: the scale layouts it is given follow PyTorch's documented rules
(``aten/src/ATen/native/cuda/ScaledBlas.cpp``, ``_scaled_block1x128_block128x128`` and friends),
which pairs and shapes it accepts, and that every GPU backend declines a CPU with a reason.
"""

from __future__ import annotations

import torch

from infir2.fp8 import get_recipe
from infir2.fp8.recipe import Cast
from infir2.kernels import BACKENDS, Operand, emulated, scaled_mm


def _op(shape: tuple[int, int], block: tuple[int, int]) -> Operand:
    return emulated.quantize(torch.randn(shape), Cast(block))


def _round_up4(n: int) -> int:
    return -(-n // 4) * 4


def test_1x128_scales_are_outer_dim_major():
    for m, k in [(256, 512), (48, 384), (16, 128)]:
        s = scaled_mm._blockwise_scale(_op((m, k), (1, 128)))
        assert s.shape == (m, k // 128)
        assert s.stride(0) == 1 and (s.shape[1] == 1 or s.stride(1) == m)
    op = _op((64, 384), (1, 128))
    assert torch.equal(scaled_mm._blockwise_scale(op), op.scale_inv)  # same values, new layout


def test_128x128_scales_are_padded_and_transposed():
    for n, k in [(384, 640), (256, 512), (128, 128)]:
        op = _op((n, k), (128, 128))
        s = scaled_mm._blockwise_scale(op)
        kb = k // 128
        assert s.shape == (_round_up4(kb), n // 128)
        assert s.stride() == (1, _round_up4(kb)) or s.shape[1] == 1
        assert torch.equal(s[:kb], op.scale_inv.t())  # the real blocks, then padding


def test_which_pairs_and_shapes_cublas_takes():
    x, w = _op((256, 512), (1, 128)), _op((384, 512), (128, 128))
    dy_w, x_w = _op((256, 384), (128, 1)), _op((256, 512), (128, 1))
    assert scaled_mm.supports_blockwise(x, w)  # fprop
    assert scaled_mm.supports_blockwise(_op((256, 384), (1, 128)), w.t())  # dgrad: 1x128 x 128x128
    assert scaled_mm.supports_blockwise(dy_w.t(), x_w.t())  # wgrad: 1x128 x 1x128
    assert not scaled_mm.supports_blockwise(w, w)  # 128x128 x 128x128 is not a cuBLAS mode
    assert not scaled_mm.supports_blockwise(_op((256, 500), (1, 128)), _op((384, 500), (128, 128)))  # K % 128
    assert not scaled_mm.supports_blockwise(_op((250, 512), (1, 128)), w)  # M % 16
    assert not scaled_mm.supports_blockwise(_op((256, 512), (1, -1)), _op((384, 512), (1, -1)))  # rowwise


def test_gpu_backends_decline_cpu_with_a_reason():
    blockwise = get_recipe("blockwise")
    assert scaled_mm.blockwise_unavailable(torch.device("cpu")) == "block-scaled scaled_mm needs CUDA"
    for name in ("scaled_mm", "triton"):
        assert "CUDA" in BACKENDS[name].why_unavailable(blockwise, torch.device("cpu"))
    assert "blockwise" in BACKENDS["triton"].why_unavailable(get_recipe("rowwise"), torch.device("cpu"))


def test_blockwise_gate_checks_the_block_scaling_kinds(monkeypatch):
    """A torch whose ``F.ScalingType`` lacks the BlockWise members is refused by name; with them, an
    SM90 device and CUDA 12.9 pass (device queries faked: no GPU here)."""
    import enum

    import torch.nn.functional as F

    gate = scaled_mm.blockwise_unavailable.__wrapped__  # the uncached function
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(F, "scaled_mm", getattr(F, "scaled_mm", lambda *a, **k: None), raising=False)
    old = enum.Enum("ScalingType", ["TensorWise", "RowWise"])
    monkeypatch.setattr(F, "ScalingType", old, raising=False)
    assert "BlockWise1x128" in gate(torch.device("cuda", 0))
    new = enum.Enum("ScalingType", ["TensorWise", "RowWise", "BlockWise1x128", "BlockWise128x128"])
    monkeypatch.setattr(F, "ScalingType", new)
    assert gate(torch.device("cuda", 0)) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert "SM90" in gate(torch.device("cuda", 0))
