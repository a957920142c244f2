"""``infir2 bench`` runs end to end on CPU and writes a well-formed JSON with sane ratios.

Speed is not asserted (CPU timings are noisy and the CPU FP8 path is emulated); what is asserted is
the shape of the report and the facts that do not depend on timing: the activations Fp8Linear
saves for backward are smaller than nn.Linear's (FP8 vs fp32), and every ratio is a positive number.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from infir2 import cli
from infir2.tools.bench import StepModel, saved_bytes, step_flops


@pytest.mark.slow
def test_bench_quick_writes_json_and_one_table(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--preset", "quick", "--iters", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["section"] for r in rows} == {"quantize", "linear", "step"}
    assert result["meta"]["backends"] == ["fast_emulated"] and result["meta"]["torch"] == torch.__version__
    for r in rows:
        if r["section"] == "step" and r["metric"] == "peak GiB":  # CUDA only
            assert r["ratio"] is None
            continue
        assert r["ratio"] is not None and math.isfinite(r["ratio"]) and r["ratio"] > 0, r
    metrics = {(r["section"], r["metric"], r["fp8"]) for r in rows}
    assert ("quantize", "GB/s", "cast") in metrics and ("quantize", "GB/s", "quantize[reference]") in metrics
    assert ("linear", "fwd+bwd ms", "nn.Linear bf16") in metrics and (
        "step",
        "TFLOP/s",
        "fp8[fast_emulated]",
    ) in metrics
    saved = [r for r in rows if r["metric"] == "saved act. MB"]
    assert saved and all(r["ratio"] < 0.5 for r in saved)  # 1-byte FP8 (+ scales) vs 4-byte fp32
    assert any(r["section"] == "step" and r["metric"] == "saved for bwd GiB" for r in rows)
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1].startswith("step")  # the table is printed last
    assert "infir2 bench" in printed


def test_saved_bytes_counts_distinct_activations_not_parameters():
    layer = nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64, requires_grad=True)
    assert saved_bytes(lambda: layer(x), [layer.weight]) == 16 * 64 * 4  # x only
    assert saved_bytes(lambda: layer(x), []) == 16 * 64 * 4 + 32 * 64 * 4  # x and W


def test_step_flops_is_six_n_t_for_a_model_without_attention_cost():
    spec = StepModel(
        hidden=128, intermediate=256, heads=1, kv_heads=1, head_dim=128, layers=1, vocab=10, seq=1
    )
    params = 4 * 128 * 128 + 3 * 128 * 256 + 128 * 10
    assert step_flops(spec, 1) == 6 * params + 6 * 128
