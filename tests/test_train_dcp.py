"""The loop with sharded (DCP) checkpoints, one process: the same curve as the full format, an exact
resume (after a crash, a SIGKILL, a damaged newest checkpoint, an interrupted save), checksums in
meta.json that an independent hash confirms, and the HF export streamed from the sharded checkpoint."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_tiny_model
from infir2.checkpoint import NoLoadableCheckpointError, load_checkpoint
from infir2.checkpoint import sharded as sc
from infir2.train import train
from train_synthetic import CrashAfter, SyntheticSource, one_thread, subprocess_env, tiny_run_config

_one_thread = pytest.fixture(autouse=True)(one_thread)
TESTS = Path(__file__).parent
DCP = {"checkpoint_format": "dcp", "async_save": True, "max_steps": 4, "save_every": 2, "keep_last": 3}


def _train(cfg, source=None):
    source = SyntheticSource(seed=1) if source is None else source
    return train(cfg, model=make_tiny_model(seed=7), train_source=source, progress=False)


def _losses(result):
    return [m["loss"] for m in result.history]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference: 4 steps in the full format; and the same run with async DCP checkpoints."""
    root = tmp_path_factory.mktemp("runs")
    full = _train(
        tiny_run_config(root, "full", train={**DCP, "checkpoint_format": "full", "async_save": False})
    )
    sharded = _train(tiny_run_config(root, "dcp", train=DCP))
    return full, sharded


def _copy(run, tmp_path, **train_kw):
    shutil.copytree(run.run_dir, tmp_path / "copy")
    (tmp_path / "copy" / ".lock").unlink(missing_ok=True)
    return tiny_run_config(tmp_path, "copy", train={**DCP, **train_kw})


def test_dcp_run_matches_full_format_and_exports_the_same_model(runs):
    full, sharded = runs
    assert _losses(sharded) == _losses(full)  # the checkpoint format does not touch the numerics
    ckpts = sc.list_sharded(sharded.run_dir / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000002", "step_00000004"]
    assert sharded.checkpoint == ckpts[-1]
    meta = json.loads((ckpts[-1] / "meta.json").read_text())
    assert meta["format"] == "dcp" and meta["step"] == 4 and "extra.pt" in meta["files"]
    for name, record in meta["files"].items():  # hashlib over the whole file: an independent checksum
        assert record["sha256"] == hashlib.sha256((ckpts[-1] / name).read_bytes()).hexdigest(), name
    # the HF folder streamed from the shards equals the one exported from the gathered full state
    ref = load_checkpoint(full.checkpoint)["model"]
    a, b = load_file(full.hf_dir / "model.safetensors"), load_file(sharded.hf_dir / "model.safetensors")
    assert a.keys() == b.keys() and set(a) <= set(ref)
    for key in a:
        assert torch.equal(a[key], b[key]) and torch.equal(b[key], ref[key]), key
    assert json.loads((sharded.hf_dir / "config.json").read_text()) == json.loads(
        (full.hf_dir / "config.json").read_text()
    )


def test_dcp_crash_and_resume_is_bit_identical(runs, tmp_path):
    full, _ = runs
    cfg = tiny_run_config(tmp_path, "split", train={**DCP, "async_save": False})
    with pytest.raises(KeyboardInterrupt):
        _train(cfg, CrashAfter(3, seed=1))  # saved at 2, died in step 3
    assert [p.name for p in sc.list_sharded(cfg.run_dir / "checkpoints")] == ["step_00000002"]
    resumed = _train(cfg)
    assert resumed.resumed_from.name == "step_00000002"
    assert [m["step"] for m in resumed.history] == [3, 4]
    assert _losses(resumed) == _losses(full)[2:]  # bit-identical: model, AdamW, data, RNG restored


def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    path.write_bytes(bytes(data))  # same size: only the checksum can tell


def test_damaged_dcp_checkpoint_is_skipped_and_all_damaged_refuses(runs, tmp_path, caplog):
    full, sharded = runs
    cfg = _copy(sharded, tmp_path)
    ckpts = cfg.run_dir / "checkpoints"
    _garble(ckpts / "step_00000004" / "__0_0.distcp")
    with caplog.at_level(logging.WARNING):
        resumed = _train(cfg)
    assert any(
        "skipping checkpoint" in r.getMessage() and "step_00000004" in r.getMessage() for r in caplog.records
    )
    assert resumed.resumed_from.name == "step_00000002" and _losses(resumed) == _losses(full)[2:]
    for folder in sc.list_sharded(ckpts):
        _garble(folder / "extra.pt")
    with pytest.raises(NoLoadableCheckpointError, match="none of the 2 checkpoints"):
        _train(cfg)


def test_interrupted_dcp_save_leaves_the_previous_checkpoint_usable(runs, tmp_path, monkeypatch):
    full, _ = runs
    cfg = tiny_run_config(tmp_path, "run", train={**DCP, "async_save": False})
    real_save, calls = sc.dcp.save, []

    def dies_on_second(state, checkpoint_id, **kw):
        calls.append(checkpoint_id)
        if len(calls) == 2:  # the final (step-4) save: some bytes on disk, then the process dies
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
            raise KeyboardInterrupt("killed mid-save")
        return real_save(state, checkpoint_id=checkpoint_id, **kw)

    monkeypatch.setattr(sc.dcp, "save", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        _train(cfg)
    monkeypatch.setattr(sc.dcp, "save", real_save)
    ckpts = cfg.run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".tmp-step_00000004", "step_00000002"]
    resumed = _train(cfg)
    assert resumed.resumed_from.name == "step_00000002" and _losses(resumed) == _losses(full)[2:]
    assert not (ckpts / ".tmp-step_00000004").exists()  # the next save removed the leftover


_KILLED = textwrap.dedent(
    """
    import sys, time, torch
    from conftest import make_tiny_model
    from infir2.train import train
    from train_synthetic import SyntheticSource, tiny_run_config

    class Slow(SyntheticSource):  # time for the kill to land anywhere: in a step, a save, a rename
        def __iter__(self):
            for step in super().__iter__():
                time.sleep(0.05)
                yield step

    torch.set_num_threads(1)
    train_kw = dict(checkpoint_format="dcp", async_save=True, max_steps=4, save_every=1, keep_last=2)
    cfg = tiny_run_config(sys.argv[1], "killed", train=train_kw)
    train(cfg, model=make_tiny_model(seed=7), train_source=Slow(seed=1), progress=False)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.1])
def test_sigkill_during_dcp_training_resumes_bit_identical(runs, tmp_path, delay):
    """``kill -9`` once the second checkpoint exists (mid step, mid async write or mid rename): the
    newest complete checkpoint resumes and the rest of the curve is bit-identical."""
    full, _ = runs
    cmd = [sys.executable, "-c", _KILLED, str(tmp_path)]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ckpts = tmp_path / "killed" / "checkpoints"
    deadline = time.monotonic() + 120
    while not (ckpts / "step_00000002").is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, out.decode()[-3000:]
    cfg = tiny_run_config(tmp_path, "killed", train={**DCP, "save_every": 1, "keep_last": 2})
    resumed = _train(cfg)
    done = resumed.resumed_from
    assert done is not None and int(done.name[5:]) >= 2
    assert _losses(resumed) == _losses(full)[int(done.name[5:]) :]
