"""FSDP2 with FP8 experts on two gloo processes: the same training as one process.

The experts' 3-D weights are sharded along the expert dimension (whole experts per rank) and
all-gathered in fp32 or as each expert's FP8 codes (``fp8.param_gather``, with the dense
projections): the same losses and weights bit for bit, fewer bytes on the wire.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train_synthetic import subprocess_env

TESTS = Path(__file__).parent


@pytest.mark.slow
def test_fp8_moe_fsdp_two_processes_equal_one(tmp_path):
    from infir2.harness.distributed import DistEnv
    from moe_fsdp_worker import moe_model, train_losses

    modes = ["fp32", "fp32-fp8gather"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(TESTS / "moe_fsdp_worker.py"), str(tmp_path), *modes]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = {mode: torch.load(tmp_path / f"{mode}.pt") for mode in modes}
    assert r["fp32-fp8gather"]["losses"] == r["fp32"]["losses"]
    for key, value in r["fp32"]["weights"].items():
        assert torch.equal(r["fp32-fp8gather"]["weights"][key], value), key
    # experts are 75% of the GEMM weights: FP8 codes (1 byte of 4) leave well under half the bytes
    assert r["fp32-fp8gather"]["wire_bytes"] < 0.5 * r["fp32"]["wire_bytes"]

    torch.set_num_threads(1)
    model = moe_model()
    one = train_losses(model, DistEnv(0, 1, torch.device("cpu"), False), 0, 1)
    assert one[0] == pytest.approx(r["fp32"]["losses"][0], rel=1e-6)  # the same forward before any update
    assert one == pytest.approx(r["fp32"]["losses"], rel=1e-4)  # then up to fp32 gradient-sum order
    weights = dict(model.state_dict())
    for key in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert torch.allclose(weights[key], r["fp32"]["weights"][key], rtol=1e-4, atol=1e-6), key
