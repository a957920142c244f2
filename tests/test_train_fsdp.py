"""Two-process FSDP2 on CPU (gloo) follows the one-process loss curve on the same global batch,
through a kill and a resume across ranks; its checkpoint and HF export are ordinary full state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import make_tiny_model
from infir2.checkpoint import load_checkpoint
from infir2.train import train
from train_fsdp_worker import CONFIG, SOURCE
from train_synthetic import SyntheticSource, one_thread, tiny_run_config, torchrun

TESTS = Path(__file__).parent
_one_thread = pytest.fixture(autouse=True)(one_thread)


@pytest.mark.slow
def test_fsdp2_two_processes_match_one_process(tmp_path):
    for phase in ("crash", "resume"):  # two launches: the resume runs in fresh processes
        torchrun(str(TESTS / "train_fsdp_worker.py"), str(tmp_path / "two"), phase)

    one = train(
        tiny_run_config(tmp_path / "one", "fsdp", **CONFIG),
        model=make_tiny_model(),
        train_source=SyntheticSource(**SOURCE),
        progress=False,
    )
    two_dir = tmp_path / "two" / "fsdp"
    two = [json.loads(line) for line in (two_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in two] == [1, 2, 3, 4]  # steps 1-2 before the kill, 3-4 after the resume
    loss_1, loss_2 = [m["loss"] for m in one.history], [m["loss"] for m in two]
    # Same micro-batches (so the same FP8 tiles) and same weights: step 1 differs only by the order of
    # fp32 additions (grad accumulation vs reduce-scatter, loss all-reduce): ~1e-7 relative. Later
    # steps add AdamW updates of fp32-rounded gradients (update size ~lr, perturbation ~1e-7 lr), and
    # an FP8 rounding of a weight may flip: still orders of magnitude below 1e-4 relative, while a
    # wrong normalisation (e.g. per-rank instead of global loss tokens) moves the loss by >1e-2.
    assert loss_2[0] == pytest.approx(loss_1[0], rel=1e-6)
    assert loss_2 == pytest.approx(loss_1, rel=1e-4)
    assert [m["tokens"] for m in two] == [m["tokens"] for m in one.history]
    # The step-1 gradient norm checks the gradient scaling (world_size / global loss tokens, then FSDP's
    # average) and the norm over DTensor shards: a factor of 2 error would show as 100%.
    assert two[0]["grad_norm"] == pytest.approx(one.history[0]["grad_norm"], rel=1e-5)

    # The 2-process checkpoint is a full state dict: it loads in one process, next to the 1-process one.
    # Weights agree to ~1% (relative Frobenius norm per tensor), not to 1e-6: AdamW turns gradient
    # elements near zero into updates of about +-lr whatever their size, so fp32 reordering noise
    # moves them; and a weight that moves across an FP8 rounding boundary changes by an E4M3 ulp
    # (~6%). The same 1-process run with micro-batches of 4 instead of 2 differs from it by 0.6%.
    a, b = load_checkpoint(one.checkpoint), load_checkpoint(two_dir / "checkpoints" / "step_00000004")
    assert b["train_state"]["world_size"] == 2 and len(b["data"]) == 2 and b["data"][1] == {"step": 4}
    assert set(a["model"]) == set(b["model"]) and set(a["optimizer"]["state"]) == set(b["optimizer"]["state"])
    for key, value in a["model"].items():
        assert float((b["model"][key] - value).norm() / value.norm()) < 2e-2, key
    assert (two_dir / "hf" / "model.safetensors").is_file()
