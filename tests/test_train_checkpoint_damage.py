"""Damaged checkpoints are detected (size + SHA-256 in meta.json), skipped with a warning naming them,
and never unpickled unsafely (``weights_only=True``: a pickle that would run code is refused)."""

from __future__ import annotations

import hashlib
import json
import logging
import os

import pytest
import torch

from infir2.checkpoint import (
    DAMAGED_PREFIX,
    NoLoadableCheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_latest_valid,
    save_checkpoint,
)
from train_synthetic import checkpoint_state


def _two_checkpoints(root):
    return [save_checkpoint(root, step, checkpoint_state(step)) for step in (1, 2)]


def _garble_same_size(state_file):
    """Overwrite bytes in the middle of the file (tensor data) with different bytes of the same length."""
    data = bytearray(state_file.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    state_file.write_bytes(bytes(data))


def _rewrite_meta_to_match(folder):
    """What an attacker (or a tool that 'repairs' meta.json) can do: make the checksum match the file."""

    meta = json.loads((folder / "meta.json").read_text())
    blob = (folder / "state.pt").read_bytes()
    meta["files"]["state.pt"] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (folder / "meta.json").write_text(json.dumps(meta))


def test_meta_records_an_independent_sha256(tmp_path):

    folder = save_checkpoint(tmp_path, 1, checkpoint_state(1))
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["format"] == "full" and meta["step"] == 1
    recorded = meta["files"]["state.pt"]["sha256"]
    assert recorded == hashlib.sha256((folder / "state.pt").read_bytes()).hexdigest()


@pytest.mark.parametrize("damage", ["same_size_garbage", "random_bytes", "truncated", "no_meta"])
def test_damaged_newest_is_skipped_with_a_warning_and_the_older_one_is_used(tmp_path, caplog, damage):
    older, newest = _two_checkpoints(tmp_path)
    state_file = newest / "state.pt"
    size = state_file.stat().st_size
    if damage == "same_size_garbage":  # loads "fine" without a checksum: the silent case
        _garble_same_size(state_file)
        assert state_file.stat().st_size == size
    elif damage == "random_bytes":
        state_file.write_bytes(os.urandom(size))
    elif damage == "truncated":
        state_file.write_bytes(state_file.read_bytes()[: size // 2])
    else:
        (newest / "meta.json").unlink()
    with pytest.raises(ValueError, match=newest.name):
        load_checkpoint(newest)
    with caplog.at_level(logging.WARNING, logger="infir2.checkpoint"):
        path, state = load_latest_valid(tmp_path)
    assert path == older and torch.equal(state["model"]["w"], checkpoint_state(1)["model"]["w"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(newest) in warnings[0], warnings


def test_random_bytes_with_a_matching_checksum_still_fail_to_load_and_are_skipped(tmp_path, caplog):
    older, newest = _two_checkpoints(tmp_path)
    (newest / "state.pt").write_bytes(os.urandom(4000))
    _rewrite_meta_to_match(newest)  # verification passes; unpickling must fail cleanly
    with pytest.raises(ValueError, match="does not load safely"):
        load_checkpoint(newest)
    with caplog.at_level(logging.WARNING, logger="infir2.checkpoint"):
        assert load_latest_valid(tmp_path)[0] == older
    assert any(str(newest) in r.getMessage() for r in caplog.records)


def test_all_damaged_refuses_to_start_unless_start_fresh(tmp_path):
    for folder in _two_checkpoints(tmp_path):
        _garble_same_size(folder / "state.pt")
    with pytest.raises(NoLoadableCheckpointError, match=r"none of the 2 checkpoints.*--start-fresh"):
        load_latest_valid(tmp_path)
    assert len(list_checkpoints(tmp_path)) == 2, "refusing must leave them untouched"
    assert load_latest_valid(tmp_path, start_fresh=True) is None
    assert list_checkpoints(tmp_path) == []  # set aside, not deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        DAMAGED_PREFIX + "step_00000001",
        DAMAGED_PREFIX + "step_00000002",
    ]
    assert load_latest_valid(tmp_path) is None  # from now on: a run folder without checkpoints


def test_no_checkpoints_is_not_an_error(tmp_path):
    assert load_latest_valid(tmp_path / "missing") is None
    assert load_latest_valid(tmp_path) is None


class _Payload:
    """Unpickling this calls ``os.open(marker, O_CREAT)``: it stands for arbitrary code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.open, (self.marker, os.O_CREAT | os.O_WRONLY))


def test_a_pickle_with_a_payload_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "payload_ran"
    root = tmp_path / "ckpts"
    folder = save_checkpoint(root, 1, checkpoint_state(1))
    evil = {**checkpoint_state(1), "scheduler": {"step": 1, "hook": _Payload(marker)}}
    torch.save(evil, folder / "state.pt")
    _rewrite_meta_to_match(folder)  # a crafted checkpoint comes with a matching meta.json
    with pytest.raises(ValueError, match=r"does not load safely.*"):
        load_checkpoint(folder)
    assert not marker.exists(), "the payload ran"
    # The test can fail: the same file does run the payload under an unsafe load.
    torch.load(folder / "state.pt", weights_only=False)
    assert marker.exists()
