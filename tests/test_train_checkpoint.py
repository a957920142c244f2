"""Checkpoints are atomic: a SIGKILL at any moment of a save leaves the previous checkpoint loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from infir2.checkpoint import (
    CHECKPOINT_KEYS,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from train_synthetic import checkpoint_state


def test_save_load_and_keep_last(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, checkpoint_state(step, 1000), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    state = load_checkpoint(latest_checkpoint(tmp_path))
    assert tuple(state) == CHECKPOINT_KEYS and torch.equal(
        state["model"]["w"], checkpoint_state(3, 1000)["model"]["w"]
    )
    with pytest.raises(ValueError, match="lacks keys"):
        save_checkpoint(tmp_path, 4, {"model": {}})


def test_writer_dying_mid_write_keeps_previous(tmp_path):
    save_checkpoint(tmp_path, 1, checkpoint_state(1, 1000))

    def dies(state, path):
        path.write_bytes(b"\x80partial")
        raise KeyboardInterrupt("killed mid-write")

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, checkpoint_state(2, 1000), writer=dies)
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert load_checkpoint(latest_checkpoint(tmp_path))["scheduler"] == {"step": 1}
    save_checkpoint(tmp_path, 2, checkpoint_state(2, 1000))  # the next save cleans the leftover temp folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]


_SAVER = textwrap.dedent(
    """
    import sys, torch
    from infir2.checkpoint import save_checkpoint
    root = sys.argv[1]
    step = 0
    while True:  # save bigger and bigger checkpoints until killed
        step += 1
        g = torch.Generator().manual_seed(step)
        state = {"model": {"w": torch.randn(200_000 + 1000 * step, generator=g)}, "optimizer": {},
                 "scheduler": {"step": step}, "data": [{"step": step}], "train_state": {"world_size": 1}}
        save_checkpoint(root, step, state, keep_last=2)
        print(step, flush=True)
    """
)


@pytest.mark.parametrize("delay", [0.05, 0.2, 0.45])
def test_sigkill_at_any_moment_leaves_a_loadable_checkpoint(tmp_path, delay):
    """A process saving checkpoints in a loop is SIGKILLed at an arbitrary moment (during a write,
    an fsync, a rename or a prune); every checkpoint folder that remains loads, and holds its step's data."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(tmp_path)], stdout=subprocess.PIPE, env=env, text=True
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # wait until the first checkpoint is complete
    assert first.strip() == "1", first
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = list_checkpoints(tmp_path)
    assert done, "the previous checkpoint must survive"
    for path in done:
        state = load_checkpoint(path)
        step = state["scheduler"]["step"]
        assert path.name == f"step_{step:08d}"
        g = torch.Generator().manual_seed(step)
        assert torch.equal(state["model"]["w"], torch.randn(200_000 + 1000 * step, generator=g))
