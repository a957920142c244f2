"""The loop resumes past a damaged checkpoint, refuses to start over damaged ones, and locks its run folder."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import make_tiny_model
from infir2.checkpoint import NoLoadableCheckpointError, list_checkpoints
from infir2.harness.lock import RunLockedError, run_lock
from infir2.train import train
from train_synthetic import SyntheticSource, one_thread, tiny_run_config

_one_thread = pytest.fixture(autouse=True)(one_thread)
_KW = {"train": {"max_steps": 4, "save_every": 2, "keep_last": 3}}


def _garble(state_file: Path) -> None:
    data = bytearray(state_file.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    state_file.write_bytes(bytes(data))  # same size: only the checksum can tell


def _train(cfg):
    return train(cfg, model=make_tiny_model(seed=7), train_source=SyntheticSource(seed=1), progress=False)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One 4-step run with checkpoints at steps 2 and 4 (the reference curve)."""
    root = tmp_path_factory.mktemp("runs")
    return _train(tiny_run_config(root, "ref", **_KW))


def _copy_run(finished, tmp_path):
    import shutil

    dst = tmp_path / "copy"
    shutil.copytree(finished.run_dir, dst)
    (dst / ".lock").unlink(missing_ok=True)
    return tiny_run_config(tmp_path, "copy", **_KW)


def test_damaged_newest_checkpoint_is_skipped_and_the_run_replays_exactly(finished, tmp_path, caplog):
    cfg = _copy_run(finished, tmp_path)
    newest = cfg.run_dir / "checkpoints" / "step_00000004"
    _garble(newest / "state.pt")
    with caplog.at_level(logging.WARNING):
        resumed = _train(cfg)
    assert any(
        "skipping checkpoint" in r.getMessage() and str(newest) in r.getMessage() for r in caplog.records
    )
    assert resumed.resumed_from.name == "step_00000002"
    assert [m["step"] for m in resumed.history] == [3, 4]
    assert [m["loss"] for m in resumed.history] == [m["loss"] for m in finished.history[2:]]  # bit-identical


def test_all_checkpoints_damaged_refuses_then_start_fresh_sets_them_aside(finished, tmp_path):
    cfg = _copy_run(finished, tmp_path)
    for folder in list_checkpoints(cfg.run_dir / "checkpoints"):
        _garble(folder / "state.pt")
    with pytest.raises(NoLoadableCheckpointError, match="none of the 2 checkpoints"):
        _train(cfg)
    assert len(list_checkpoints(cfg.run_dir / "checkpoints")) == 2  # untouched
    fresh = _train(tiny_run_config(tmp_path, "copy", load={"start_fresh": True}, **_KW))
    assert fresh.resumed_from is None and [m["loss"] for m in fresh.history] == [
        m["loss"] for m in finished.history
    ]
    names = sorted(p.name for p in (cfg.run_dir / "checkpoints").iterdir())
    assert names == ["damaged-step_00000002", "damaged-step_00000004", "step_00000002", "step_00000004"]


_HOLDER = textwrap.dedent(  # lock.py needs only the standard library: load it alone (no torch import, fast)
    """
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("lock", sys.argv[2])
    lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lock)
    with lock.run_lock(sys.argv[1]):
        print("held", flush=True)
        time.sleep(600)
    """
)


def test_a_second_process_is_refused_with_the_holders_pid_and_the_lock_dies_with_it(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    lock_py = Path(__file__).parents[1] / "src" / "infir2" / "harness" / "lock.py"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(run_dir), str(lock_py)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=rf"in use by process {holder.pid}\b"), run_lock(run_dir):
            pass
        cfg = tiny_run_config(tmp_path, "run", train={"max_steps": 1})
        with pytest.raises(RunLockedError, match=str(holder.pid)):
            _train(cfg)
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # the refused run wrote nothing
    finally:
        holder.send_signal(signal.SIGKILL)  # the holder dies without cleaning up
        holder.wait()
    with run_lock(run_dir) as path:  # not stale: the kernel released the dead holder's flock
        assert path is not None and path.read_text().strip() == str(os.getpid())
    with run_lock(run_dir):  # released on exit of the block
        pass
