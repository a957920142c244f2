"""No wasted work in a training step: what ``Fp8Linear`` asks of its backend per forward/backward.

The weight is quantized once per optimizer step under ``cache_fp8_weights`` and the saved activation
is FP8 (both tested in ``test_nn_fp8linear.py``). Here: the backend is chosen once, not re-queried
per forward; a layer without bias gets its output from the GEMM in the input's dtype (no fp32
``[T, N]`` intermediate); each operand is quantized exactly once per GEMM that needs it; and the hot
path has no host synchronization (no ``.item()``/``.tolist()``/``.cpu()`` in kernels/ and nn/);
layers fed the same tensor (q/k/v, gate/up) quantize it once and save one shared FP8 copy.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from infir2.kernels import BACKENDS
from infir2.nn import Fp8Linear, cache_fp8_weights
from infir2.tools.bench import saved_bytes

SRC = Path(__file__).resolve().parents[1] / "src" / "infir2"


@pytest.fixture
def recording(monkeypatch):
    """The emulated backend, recording every quantize (block), GEMM (out dtype) and binding call."""
    base = BACKENDS["emulated"]
    calls: dict[str, list] = {"quantize": [], "gemm": [], "available": []}
    quantize, gemm_nt, why_unavailable = base.quantize, base.gemm_nt, base.why_unavailable

    def recording_quantize(x, cast):
        calls["quantize"].append((tuple(x.shape), tuple(cast.block)))
        return quantize(x, cast)

    def recording_gemm(a, b, out_dtype):
        calls["gemm"].append(out_dtype)
        return gemm_nt(a, b, out_dtype)

    def recording_why_unavailable(recipe, device):
        calls["available"].append(device)
        return why_unavailable(recipe, device)

    monkeypatch.setattr(base, "quantize", recording_quantize)  # quantize_pair calls it too
    monkeypatch.setattr(base, "gemm_nt", recording_gemm)
    monkeypatch.setattr(base, "why_unavailable", recording_why_unavailable)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_per_operand_and_output_in_input_dtype(recording, dtype):
    layer = Fp8Linear(256, 384, bias=False, backend="emulated", dtype=dtype)
    with cache_fp8_weights(layer):
        for _ in range(3):  # three micro-batches of one step
            x = torch.randn(2, 64, 256, dtype=dtype, requires_grad=True)
            layer(x).float().sum().backward()
    blocks = [b for _, b in recording["quantize"]]
    assert blocks.count((128, 128)) == 1  # the weight: once per step, reused by fprop and dgrad
    assert blocks.count((1, 128)) == 3 * 2  # X for fprop, dY for dgrad, per micro-batch
    assert blocks.count((128, 1)) == 3 * 2  # X and dY for wgrad, per micro-batch
    assert len(recording["available"]) == 1  # backend chosen once, not per forward
    fprop, dgrad, wgrad = recording["gemm"][:3]
    assert fprop == dtype and dgrad == dtype and wgrad == torch.float32


def test_bias_is_added_in_fp32_before_the_single_rounding(recording):
    layer = Fp8Linear(256, 128, bias=True, backend="emulated", dtype=torch.bfloat16)
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    y = layer(x)
    assert recording["gemm"] == [torch.float32] and y.dtype == torch.bfloat16
    without_bias = Fp8Linear.from_linear(torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16))
    without_bias.weight = layer.weight
    expected = (without_bias(x.float()).float() + layer.bias.float()).bfloat16()
    assert torch.equal(y, expected)


#: the one host read the experts take (nn/moe/): each block's per-expert row counts, which the loop of
#: dense GEMMs needs on the host (the CPU emulations run over device offsets, nn/moe/offsets.py; no GPU
#: blockwise grouped kernel is built yet)
MOE_ROUTING = "# MoE routing:"
MOE = SRC / "nn" / "moe"


def test_no_host_sync_in_the_hot_path():
    pattern = re.compile(r"\.item\(\)|\.tolist\(\)|\.cpu\(\)|\.numpy\(\)|cuda\.synchronize")
    assert sorted(MOE.glob("*.py")), f"no experts under {MOE}"  # the scan below reads them
    routing = [
        f"{path.name}:{i}"
        for path in sorted(MOE.glob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and MOE_ROUTING in line
    ]
    assert len(routing) <= 3, routing  # forward (eager), and the compiled path's forward and backward
    hits = [
        f"{path.relative_to(SRC)}:{i}: {line.strip()}"
        for folder in ("kernels", "nn")
        for path in sorted((SRC / folder).rglob("*.py"))
        if path != SRC / "nn" / "telemetry.py"  # reads its numbers back on opt-in stats steps only, by design
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
        and "# off the hot path:" not in line  # e.g. only after a backend failed
        and not (path.parent == MOE and MOE_ROUTING in line)
    ]
    assert not hits, "host syncs in the FP8 hot path:\n" + "\n".join(hits)


def test_layers_sharing_an_input_quantize_it_once(recording):
    torch.manual_seed(0)
    q, k, v = (Fp8Linear(256, n, bias=False, backend="emulated") for n in (256, 128, 128))
    h = torch.randn(2, 64, 256, requires_grad=True)
    params = [m.weight for m in (q, k, v)]

    def attention_inputs() -> torch.Tensor:
        return q(h).sum() + k(h).sum() + v(h).sum()

    shared = saved_bytes(attention_inputs, params)
    x_blocks = [b for shape, b in recording["quantize"] if shape == (128, 256) and b != (128, 128)]
    assert sorted(x_blocks) == [(1, 128), (128, 1)]  # once per tiling, not three times
    wq = sum(m.quantized_weight().nbytes() for m in (q, k, v))
    x_fp8 = 128 * 256 + 256 * 4  # one FP8 wgrad copy [T, K] + its 1 x 256 scales (128x1 tiles)
    assert shared - wq == x_fp8
    h2 = h.detach().clone().requires_grad_()  # a different tensor with the same values: no reuse
    out1, out2 = q(h).detach(), q(h2).detach()
    assert torch.equal(out1, out2)
    with torch.no_grad():
        h.mul_(2)  # an in-place change bumps the version: quantized again, new values
    assert torch.equal(q(h).detach(), 2 * out1)
