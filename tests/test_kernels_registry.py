"""The fallback chain with fake backends: which errors fall back, which surface, and the defaults.

A fake backend is a namespace with a ``NAME`` and the jobs it claims, ending in the emulated backend
as every real chain does; the result of a job that falls back must be the emulated result exactly.
"""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch

from infir2.fp8 import get_recipe
from infir2.fp8.recipe import Cast
from infir2.kernels import BACKENDS, ORDER, Backend, Kernels, Operand, bind, emulated, registry

ROW, WEIGHT = Cast((1, 128)), Cast((128, 128))


def _chain(fake: SimpleNamespace, device: str = "cpu") -> Kernels:
    return Kernels(get_recipe("blockwise"), torch.device(device), (Backend(fake), BACKENDS["emulated"]))


def _raising(error: BaseException, calls: list[str]):
    def job(*args):
        calls.append(type(error).__name__)
        raise error

    return job


def _operands() -> tuple[Operand, Operand]:
    g = torch.Generator().manual_seed(0)
    return emulated.quantize(torch.randn(16, 256, generator=g), ROW), emulated.quantize(
        torch.randn(32, 256, generator=g), WEIGHT
    )


def _triton_error() -> BaseException:
    errors = pytest.importorskip("triton.errors")
    return type("OutOfResources", (errors.TritonError,), {})("shared memory, required: 98304")


@pytest.mark.parametrize(
    "error",
    [
        lambda: ValueError("scaled_mm: expected scale_a of shape [16, 2]"),  # PyTorch's TORCH_CHECK_VALUE
        lambda: RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul"),
        lambda: NotImplementedError("not on this build"),
        _triton_error,  # a Triton compile / resource error
    ],
)
def test_a_declining_backend_falls_back_once_and_for_good(error, caplog):
    calls: list[str] = []
    a, b = _operands()
    kernels = _chain(SimpleNamespace(NAME="fake", gemm_nt=_raising(error(), calls)))
    with caplog.at_level(logging.WARNING, logger="infir2.kernels.registry"):
        first = kernels.gemm_nt(a, b, torch.float32)
        second = kernels.gemm_nt(a, b, torch.float32)
    assert torch.equal(first, emulated.gemm_nt(a, b, torch.float32)) and torch.equal(second, first)
    assert len(calls) == 1  # passed over from then on
    assert "on the fake backend" in caplog.text and "the next backend runs it" in caplog.text


def test_quantize_and_quantize_pair_fall_back_like_the_gemm():
    calls: list[str] = []
    x = torch.randn(8, 256)
    fake = SimpleNamespace(NAME="fake", quantize=_raising(ValueError("no"), calls))
    kernels = _chain(fake)
    got = kernels.quantize(x, ROW)
    ref = emulated.quantize(x, ROW)
    assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(got.scale_inv, ref.scale_inv)
    pair = kernels.quantize_pair(x, ROW, Cast((128, 1)))  # another kind of job: tried, then passed over
    assert torch.equal(pair[1].scale_inv, emulated.quantize(x, Cast((128, 1))).scale_inv)
    kernels.quantize(x, ROW)
    assert calls == ["ValueError", "ValueError"]


@pytest.mark.parametrize("error", [TypeError("bad argument"), AssertionError("shape"), KeyError("k")])
def test_a_bug_in_a_backend_surfaces(error):
    a, b = _operands()
    kernels = _chain(SimpleNamespace(NAME="fake", gemm_nt=_raising(error, [])))
    with pytest.raises(type(error)):
        kernels.gemm_nt(a, b, torch.float32)


def test_out_of_memory_is_not_fallen_back_from():
    a, b = _operands()
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    kernels = _chain(SimpleNamespace(NAME="fake", gemm_nt=_raising(oom, [])))
    with pytest.raises(torch.OutOfMemoryError) as info:
        kernels.gemm_nt(a, b, torch.float32)
    assert any("GEMM (1, 128) x (128, 128)" in n and "fake backend" in n for n in info.value.__notes__)


def test_a_cuda_fault_is_reraised_with_the_job_named(monkeypatch):
    """After a failure on a CUDA device the registry synchronizes: a sticky error (the device is broken;
    falling back would only move the error to some later call) is re-raised, naming the job."""
    a, b = _operands()
    calls: list[str] = []
    sticky = RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")

    def broken_device(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", broken_device)
    kernels = _chain(SimpleNamespace(NAME="fake", gemm_nt=_raising(sticky, calls)), device="cuda:0")
    with pytest.raises(RuntimeError, match="illegal memory access") as info:
        kernels.gemm_nt(a, b, torch.float32)
    note = " ".join(info.value.__notes__)
    assert "fake backend (cuda:0) failed" in note and "CUDA error state" in note
    assert not kernels._broken  # not marked as declined: nothing was fallen back to

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # a healthy device
    out = kernels.gemm_nt(a, b, torch.float32)  # the same error is now a refusal: falls back
    assert torch.equal(out, emulated.gemm_nt(a, b, torch.float32)) and len(calls) == 2


def test_accelerator_errors_are_faults():
    a, b = _operands()
    fault = torch.AcceleratorError("CUDA error: misaligned address")
    kernels = _chain(SimpleNamespace(NAME="fake", gemm_nt=_raising(fault, [])))
    with pytest.raises(torch.AcceleratorError):
        kernels.gemm_nt(a, b, torch.float32)


def test_the_registry_supplies_what_a_backend_leaves_out():
    gemm_only = Backend(SimpleNamespace(NAME="gemm-only", gemm_nt=lambda a, b, dtype: None))
    x = torch.randn(4, 128)
    assert gemm_only.why_unavailable(get_recipe("blockwise"), torch.device("cpu")) is None
    assert not gemm_only.supports_quantize(x, ROW)
    a, b = _operands()
    assert gemm_only.supports_gemm(a, b, torch.float32)
    seen: list[Cast] = []
    quantize_only = Backend(SimpleNamespace(NAME="q", quantize=lambda x, c: seen.append(c) or c))
    assert quantize_only.quantize_pair(x, ROW, WEIGHT) == (ROW, WEIGHT) and seen == [ROW, WEIGHT]
    assert not quantize_only.supports_gemm(a, b, torch.float32)
    assert not BACKENDS["scaled_mm"].supports_quantize(x, ROW)  # GEMMs only: no stubs in the module
    reference = BACKENDS["emulated"]
    assert reference.supports_quantize(x, ROW) and reference.supports_gemm(a, b, torch.float32)


def test_scaled_mm_is_not_in_the_cpu_chain_but_runs_when_asked():
    assert "scaled_mm" not in ORDER["cpu"]
    assert [b.NAME for b in bind(get_recipe("rowwise"), "cpu").chain] == ["fast_emulated", "emulated"]
    assert bind(get_recipe("rowwise"), "cpu", "scaled_mm").name == "scaled_mm"


def test_scaled_mm_refuses_e5m2_times_e5m2():
    def op(fmt: str) -> Operand:
        return emulated.quantize(torch.randn(32, 64), Cast((1, -1), fmt))

    scaled_mm = BACKENDS["scaled_mm"]
    assert scaled_mm.supports_gemm(op("e4m3"), op("e5m2"), torch.float32)
    assert scaled_mm.supports_gemm(op("e5m2"), op("e4m3"), torch.float32)
    assert not scaled_mm.supports_gemm(op("e5m2"), op("e5m2"), torch.float32)
    assert registry.BACKENDS is BACKENDS


@pytest.mark.parametrize(
    ("recipe", "capability", "why"),
    [
        ("blockwise", (8, 0), "FP8 GEMMs need an SM89\\+ GPU"),  # an A100
        (
            "mxfp8",
            (10, 0),
            "needs an SM90 GPU \\(this is SM10x\\)",
        ),  # MX blocks on Blackwell: no cuBLAS path yet
    ],
)
def test_a_gpu_layer_on_the_emulated_backend_warns_once(recipe, capability, why, monkeypatch, caplog):
    """A CUDA layer whose GEMMs can only run emulated says so once per recipe and device, naming the layer
    and why each GPU backend is out (the GPU is faked: its capability)."""
    from infir2.kernels import scaled_mm
    from infir2.nn import Fp8Linear, module

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(module, "_WARNED_EMULATED", set())
    scaled_mm.blockwise_unavailable.cache_clear()
    layers = [Fp8Linear(256, 256, recipe=recipe, device="meta") for _ in range(3)]
    layers[0].fp8_name = "model.layers.0.mlp.up_proj"
    try:
        with caplog.at_level(logging.WARNING, logger="infir2.nn.module"):
            for layer in layers:
                assert layer.bind_kernels("cuda:0").name == "emulated"
    finally:
        scaled_mm.blockwise_unavailable.cache_clear()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "model.layers.0.mlp.up_proj" in warnings[0] and "cuda:0" in warnings[0]
    assert re.search(why, warnings[0]) and "triton:" in warnings[0], warnings[0]


def test_a_gemm_falling_to_the_emulated_backend_on_a_gpu_is_a_warning(caplog):
    a, b = _operands()
    declining = SimpleNamespace(NAME="fake", supports_gemm=lambda a, b, out_dtype: False, gemm_nt=None)
    for device, level in (("cuda:0", logging.WARNING), ("cpu", logging.INFO)):
        kernels = Kernels(
            get_recipe("blockwise"), torch.device(device), (Backend(declining), BACKENDS["emulated"])
        )
        with caplog.at_level(logging.INFO, logger="infir2.kernels.registry"):
            caplog.clear()
            kernels._first(lambda be: be.supports_gemm(a, b, torch.float32), lambda: f"GEMM on {device}")  # noqa: B023
        (record,) = [r for r in caplog.records if "runs on emulated" in r.getMessage()]
        assert record.levelno == level, (device, record.levelno)
