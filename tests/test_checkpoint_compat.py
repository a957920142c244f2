"""Checkpoints written by earlier versions of infir2 still verify, resume and export.

``tests/fixtures/checkpoints_v1/`` holds one ``full`` and one ``dcp`` checkpoint of the same tiny run
(a 1-layer Qwen2 of width 32, recipe ``bf16``, fp32 masters, 2 of 4 optimizer steps done), written by
the code before the checkpoint package (``infir2.checkpoint`` as one module, its ``meta.json`` with
``state_bytes`` / ``state_sha256``; ``infir2.train.sharded_checkpoint``), and ``expected.json`` with the
losses of steps 3 and 4 that this code computed after resuming from them. The fixture is data from
the past: do not regenerate it with today's code (``python tests/test_checkpoint_compat.py --write``
is how it was written, and writes today's format).

The comparison has a tolerance (1e-5 relative) because the fp32 GEMMs of a resumed step round
differently on another CPU; there is no FP8 in the run, so there is no FP8 code to flip.
"""

from __future__ import annotations

import json
import shutil
import sys
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
def test_an_old_checkpoint_resumes_where_it_left_off(tmp_path, fmt):
    cfg = _config(tmp_path, fmt)
    (cfg.run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(_step_folder(fmt), cfg.run_dir / "checkpoints" / _step_folder(fmt).name)
    result = train(cfg, model=_model(), train_source=_source(), progress=False)
    assert result.resumed_from is not None and result.resumed_from.name == _step_folder(fmt).name
    expected = json.loads((FIXTURE / "expected.json").read_text())["losses_after_resume"]
    got = [m["loss"] for m in result.history]
    assert [m["step"] for m in result.history] == [3, 4]
    assert got == pytest.approx(expected, rel=1e-5)


def test_old_full_and_dcp_checkpoints_hold_the_same_model():
    """Both formats of the same run read back to the same tensors (the dcp one through the streamed export)."""
    from infir2.checkpoint import iter_model_tensors, load_checkpoint

    full = load_checkpoint(_step_folder("full"))["model"]
    streamed = dict(iter_model_tensors(_step_folder("dcp")))
    assert sorted(streamed) == sorted(full) and len(full) > 10
    for name, tensor in full.items():
        assert torch.equal(streamed[name], tensor), name


if __name__ == "__main__":  # how the fixture was written (by the code of its time; see the docstring)
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_checkpoint_compat.py --write")
    torch.set_num_threads(1)
    losses = {}
    for fmt in FORMATS:
        out = Path(sys.argv[0]).parent / "fixtures" / "_write" / fmt
        shutil.rmtree(out, ignore_errors=True)
        cfg = _config(out, fmt)
        result = train(cfg, model=_model(), train_source=_source(), progress=False)
        losses[fmt] = [m["loss"] for m in result.history]
        shutil.rmtree(FIXTURE / fmt, ignore_errors=True)
        (FIXTURE / fmt).mkdir(parents=True)
        shutil.copytree(cfg.run_dir / "checkpoints" / f"step_{SAVED_STEP:08d}", _step_folder(fmt))
    assert losses["full"] == losses["dcp"], losses
    (FIXTURE / "expected.json").write_text(
        json.dumps(
            {
                "note": "written by infir2 before the checkpoint package; losses of steps 1-4 of one run",
                "losses": losses["full"],
                "losses_after_resume": losses["full"][SAVED_STEP:],
            },
            indent=1,
        )
        + "\n"
    )
    shutil.rmtree(Path(sys.argv[0]).parent / "fixtures" / "_write")
    print(losses)
