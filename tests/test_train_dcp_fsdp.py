"""Two FSDP2 processes (gloo) with sharded (DCP) checkpoints: the one-process curve through a kill and a
resume; the 2-process checkpoint resumes in one process (resharded) and continues the curve; the HF
folder streamed from the shards holds exactly the checkpoint's weights. One torchrun launch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_tiny_model
from infir2.checkpoint import list_sharded, load_sharded
from infir2.harness.distributed import DistEnv
from infir2.model import prepare_for_training
from infir2.train import train
from train_dcp_worker import TRAIN
from train_fsdp_worker import SOURCE
from train_synthetic import SyntheticSource, one_thread, tiny_run_config, torchrun

TESTS = Path(__file__).parent
ONE = DistEnv(0, 1, torch.device("cpu"), False)
_one_thread = pytest.fixture(autouse=True)(one_thread)


@pytest.mark.slow
def test_two_process_dcp_run_resumes_and_reshards_onto_one_process(tmp_path):
    torchrun(str(TESTS / "train_dcp_worker.py"), str(tmp_path / "two"), timeout=400)
    two_dir = tmp_path / "two" / "dcp"
    two = [json.loads(line) for line in (two_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in two] == [1, 2, 3, 4, 5, 6]  # 1-2 before the kill, 3-6 after the resume

    one = train(
        tiny_run_config(
            tmp_path / "one", "ref", train={**TRAIN, "checkpoint_format": "full", "async_save": False}
        ),
        model=make_tiny_model(),
        train_source=SyntheticSource(**SOURCE),
        progress=False,
    )
    # the same data (loss-token counts differ per step: an exact check of the data position), and the
    # tolerances of test_train_fsdp.py for its 4 steps (fp32 reduction order; see the reasoning there);
    # the AdamW-amplified noise grows to ~2e-4 by step 5, while a wrong data position moves the loss >1e-2
    assert [m["loss_tokens"] for m in two] == [m["loss_tokens"] for m in one.history]
    assert two[0]["loss"] == pytest.approx(one.history[0]["loss"], rel=1e-6)
    assert [m["loss"] for m in two[:4]] == pytest.approx([m["loss"] for m in one.history[:4]], rel=1e-4)
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one.history], rel=1e-3)

    # Resharding: the 2-process step-4 checkpoint resumes in one process and finishes the same curve.
    ckpts = [p.name for p in list_sharded(two_dir / "checkpoints")]
    assert ckpts == ["step_00000004", "step_00000006"]
    shutil.copytree(two_dir, tmp_path / "copy" / "dcp")
    shutil.rmtree(tmp_path / "copy" / "dcp" / "checkpoints" / "step_00000006")
    (tmp_path / "copy" / "dcp" / ".lock").unlink(missing_ok=True)
    cont = train(
        tiny_run_config(tmp_path / "copy", "dcp", train=TRAIN),
        model=make_tiny_model(seed=7),
        train_source=SyntheticSource(**SOURCE),
        progress=False,
    )
    assert cont.resumed_from.name == "step_00000004" and [m["step"] for m in cont.history] == [5, 6]
    # data: the global sample count of step 4 (global batch 8: samples 32..47 for steps 5-6)
    assert [m["loss_tokens"] for m in cont.history] == [m["loss_tokens"] for m in one.history[4:]]
    assert [m["loss"] for m in cont.history] == pytest.approx([m["loss"] for m in two[4:]], rel=1e-4)

    # The 2-process HF export (streamed from the step-6 shards) equals the checkpoint loaded in one process.
    model = prepare_for_training(make_tiny_model(seed=3), "blockwise")
    extra = load_sharded(two_dir / "checkpoints" / "step_00000006", model, None, ONE)
    assert extra["train_state"]["world_size"] == 2 and extra["data"] == [{"step": 6}, {"step": 6}]
    exported = load_file(two_dir / "hf" / "model.safetensors")
    state = model.state_dict()
    assert exported.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(exported[key], value), key
