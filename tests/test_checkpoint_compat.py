"""Checkpoints written by earlier, unreleased versions of infir2: still verified and read as tensors, but a
run does not resume from them.

``tests/fixtures/checkpoints_v1/`` holds one ``full`` and one ``dcp`` checkpoint of the same tiny run
(a 1-layer Qwen2 of width 32, recipe ``bf16``, fp32 masters, 2 of 4 optimizer steps done), written by
the code before the checkpoint package (``infir2.checkpoint`` as one module, its ``meta.json`` with
``state_bytes`` / ``state_sha256``; ``infir2.train.sharded_checkpoint``), whose counters were still
``nonfinite_total`` / ``nonfinite_in_row``. No release has written that layout, so resuming from it is
refused in one line naming the folder and the counters expected now (CONTRIBUTING.md, "Layouts no
release has written"). The fixture is data from the past: do not regenerate it with today's code.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model
from infir2.train import train
from train_synthetic import SyntheticSource, one_thread, tiny_run_config

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoints_v1"
FORMATS = ("full", "dcp")
SAVED_STEP, STEPS = 2, 4
_one_thread = pytest.fixture(autouse=True)(one_thread)


def _model() -> torch.nn.Module:
    """The model the fixture was written with (keep it: the saved weights are this model's)."""
    return make_tiny_model(vocab_size=64, hidden=32, layers=1, intermediate=64, max_positions=64)


def _config(out_dir: Path, fmt: str):
    return tiny_run_config(
        out_dir,
        fmt,
        fp8={"recipe": "bf16"},
        train={"max_steps": STEPS, "save_every": SAVED_STEP, "checkpoint_format": fmt},
    )


def _source() -> SyntheticSource:
    return SyntheticSource(vocab_size=64, seq_len=16, seed=5)


def _step_folder(fmt: str) -> Path:
    return FIXTURE / fmt / f"step_{SAVED_STEP:08d}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_checkpoint_of_an_unreleased_layout_is_refused_in_one_line(tmp_path, fmt):
    """Its counters have the names before ``skipped_*``: no release wrote them, so none is translated."""
    cfg = _config(tmp_path, fmt)
    (cfg.run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(_step_folder(fmt), cfg.run_dir / "checkpoints" / _step_folder(fmt).name)
    with pytest.raises(ValueError) as e:
        train(cfg, model=_model(), train_source=_source(), progress=False)
    message = str(e.value)
    assert message.startswith(f"checkpoint {cfg.run_dir / 'checkpoints' / _step_folder(fmt).name}: ")
    assert "train_state holds the counters nonfinite_in_row, nonfinite_total, step, tokens_seen" in message
    assert "TrainState has skipped_in_row, skipped_total, step, tokens_seen" in message
    assert "a layout this version does not read" in message and "\n" not in message
    assert [p.name for p in (cfg.run_dir / "checkpoints").iterdir()] == [_step_folder(fmt).name]  # kept


def test_old_full_and_dcp_checkpoints_hold_the_same_model():
    """Both formats of the same run read back to the same tensors (the dcp one through the streamed export)."""
    from infir2.checkpoint import iter_model_tensors, load_checkpoint

    full = load_checkpoint(_step_folder("full"))["model"]
    streamed = dict(iter_model_tensors(_step_folder("dcp")))
    assert sorted(streamed) == sorted(full) and len(full) > 10
    for name, tensor in full.items():
        assert torch.equal(streamed[name], tensor), name
