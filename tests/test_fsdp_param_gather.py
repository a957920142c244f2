"""FSDP2 all-gather in bf16 and as FP8 codes (infir2.nn.fsdp): the GEMMs see exactly the weights of one process.

The sharded quantization is checked against ``infir2.fp8.quantize.quantize`` of the whole weight for
shard boundaries that cut 128-row blocks (including empty and short last shards, NaN and inf); the
gathered-weight path of ``Fp8Linear`` against its ordinary path; and two processes on gloo (slow:
two torchrun launches' worth of start-up) train bit-identically with the FP8 all-gather on and off.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from infir2.fp8.quantize import quantize, quantize_with_amax
from infir2.fp8.recipe import get_recipe
from infir2.nn import Fp8Linear
from infir2.nn.fsdp import Fp8GatheredWeight, partial_block_amax
from train_synthetic import torchrun

TESTS = Path(__file__).parent


@pytest.mark.parametrize(
    ("rows", "cols", "world"),
    [(1536, 256, 8), (200, 300, 2), (130, 128, 3), (5, 129, 4), (384, 128, 2), (64, 128, 1)],
)
@pytest.mark.parametrize("block", [(128, 128), (-1, -1)])
def test_sharded_quantization_matches_one_process(rows, cols, world, block):
    torch.manual_seed(rows + cols)
    w = torch.randn(rows, cols) * torch.logspace(-3, 2, cols)  # blocks with very different amaxes
    w[rows // 3, 1], w[-1, -1] = float("nan"), float("inf")
    per_rank = math.ceil(
        rows / world
    )  # FSDP2's torch.chunk rule: the last ranks may hold fewer rows, or none
    shards = [(r * per_rank, w[r * per_rank : (r + 1) * per_rank]) for r in range(world)]
    # all_reduce(MAX) over ranks, done here by stacking the partial amaxes
    amax = torch.stack([partial_block_amax(s, offset, rows, block) for offset, s in shards]).amax(0)
    out = [
        quantize_with_amax(s, amax, block, "e4m3", "pow2", row_offset=offset, n_rows=rows)
        for offset, s in shards
    ]
    data, scale_inv = quantize(w, block, "e4m3", "pow2")
    assert torch.equal(torch.cat([codes for codes, _ in out]).view(torch.uint8), data.view(torch.uint8))
    for _, shard_scale_inv in out:
        assert torch.equal(shard_scale_inv, scale_inv)


def test_partial_amax_covers_only_own_rows():
    w = torch.ones(256, 128)
    w[100] = 5.0  # row 100 is in block 0, on the first rank of two (rows 0-127)
    first, second = (
        partial_block_amax(w[:128], 0, 256, (128, 128)),
        partial_block_amax(w[128:], 128, 256, (128, 128)),
    )
    assert first.tolist() == [[5.0], [0.0]] and second.tolist() == [[0.0], [1.0]]


def _grads(layer: Fp8Linear, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
    grads = (y.detach(), x.grad, layer.weight.grad, layer.bias.grad)
    layer.zero_grad(set_to_none=True)
    return grads


def test_gathered_weight_runs_the_same_gemms():
    torch.manual_seed(0)
    layer = Fp8Linear(256, 200, recipe="blockwise")
    x = torch.randn(3, 256)
    expected = _grads(layer, x)
    master = layer.weight
    operand = layer.quantized_weight()
    layer.weight = torch.nn.Parameter(Fp8GatheredWeight(operand, torch.float32))  # as FSDP2 sets it
    got = _grads(layer, x)
    for e, g in zip(expected, got, strict=True):
        assert g is not None and type(g) is torch.Tensor and torch.equal(e, g)
    # any other use (FP8 off) sees the gathered, i.e. dequantized FP8 weight
    layer.fp8_enabled = False
    ref = torch.nn.functional.linear(x, operand.dequantize(), layer.bias)
    assert torch.equal(layer(x), ref) and not torch.equal(
        ref, torch.nn.functional.linear(x, master, layer.bias)
    )


def test_gathered_scales_are_recorded_on_the_compute_stream(monkeypatch):
    """``scale_inv`` comes from FSDP2's copy-in stream; the gathered weight records it on the current
    (compute) stream so its memory is not reused while forward / backward may still read it. The
    CUDA tensor and stream are stand-ins here (the GPU run is ``tests/gpu``, under the sanitizer)."""
    from infir2.nn.fsdp import Fp8ShardedWeight

    class CudaScales:  # what post_all_gather needs of a CUDA scale_inv
        is_cuda, device = True, torch.device("cuda", 0)

        def __init__(self) -> None:
            self.recorded: list[object] = []

        def record_stream(self, stream):
            self.recorded.append(stream)

    compute_stream = object()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute_stream)
    scales = CudaScales()
    shard = Fp8ShardedWeight(torch.zeros(2, 128))
    codes = torch.zeros(256, 128, dtype=torch.uint8)
    gathered, _ = shard.fsdp_post_all_gather((codes,), (scales, (128, 128), "e4m3", 200), torch.float32)
    assert scales.recorded == [compute_stream]
    assert gathered.operand.scale_inv is scales and gathered.shape == (200, 128)


def test_param_gather_setting():
    from infir2.train.config import parse_config

    def on(setting, name):
        return get_recipe(name).param_gather(setting)

    assert on(None, "blockwise") and on(None, "blockwise_fp32scale")
    assert not on(None, "tensorwise") and on(True, "tensorwise")
    assert not on(False, "blockwise") and not on(None, "bf16")
    assert not get_recipe("rowwise").gathers_fp8_weight  # dgrad needs the weight in columns
    with pytest.raises(ValueError, match=r"fp8\.param_gather"):
        parse_config({"fp8": {"recipe": "rowwise", "param_gather": True}}, "run.yaml")


@pytest.mark.slow
def test_fp8_param_gather_two_processes(tmp_path):
    from fsdp_param_gather_worker import fp8_model, train_and_eval
    from infir2.harness.distributed import DistEnv

    modes = ["fp32", "fp32-fp8gather", "bf16", "bf16-fp8gather"]
    torchrun(str(TESTS / "fsdp_param_gather_worker.py"), str(tmp_path), *modes)
    # (the worker also asserted, on both ranks, that every FP8 weight arrived bit-identical to
    # quantize(full weight) of one process)
    r = {mode: torch.load(tmp_path / f"{mode}.pt") for mode in modes}

    # FP8 all-gather on and off: the same quantized weights, so the same losses (an evaluation with
    # FP8 off included) and final weights, bit for bit
    assert r["fp32-fp8gather"]["losses"] == r["fp32"]["losses"]
    for key, value in r["fp32"]["weights"].items():
        assert torch.equal(r["fp32-fp8gather"]["weights"][key], value), key

    # and the same run as one process, up to the order of fp32 gradient sums (see test_train_fsdp)
    torch.set_num_threads(1)
    model = fp8_model()
    one = train_and_eval(model, "fp32", DistEnv(0, 1, torch.device("cpu"), False), 0, 1)
    assert one[0] == pytest.approx(r["fp32"]["losses"][0], rel=1e-6)
    assert one == pytest.approx(r["fp32"]["losses"], rel=1e-4)

    # bf16 all-gather: bf16 weights and fp32 gradient reduction move the loss at the bf16 level only
    assert r["bf16"]["losses"] == pytest.approx(r["fp32"]["losses"], rel=1e-2)
    assert r["bf16-fp8gather"]["losses"] == pytest.approx(r["bf16"]["losses"], rel=1e-2)
    # every gathered byte halves with bf16; the FP8 codes take half of that again for the projections
    assert r["bf16"]["wire_bytes"] * 2 == r["fp32"]["wire_bytes"]
    assert r["bf16-fp8gather"]["wire_bytes"] < r["bf16"]["wire_bytes"]
    assert r["fp32-fp8gather"]["wire_bytes"] < r["fp32"]["wire_bytes"]
