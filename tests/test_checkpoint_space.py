"""Disk space for checkpoints: the room a save needs is checked before writing, a full disk during a
write is one clear line, and the previous checkpoint stays intact (``infir2.checkpoint.space``)."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import shutil
import subprocess
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model
from infir2.checkpoint import (
    InsufficientSpaceError,
    check_room_for_saves,
    latest_checkpoint,
    list_checkpoints,
    load_sharded,
    save_bytes,
    save_checkpoint,
    save_sharded,
    verify,
)
from infir2.checkpoint import full as full_module
from infir2.checkpoint import space as space_module
from infir2.harness.distributed import DistEnv
from infir2.harness.optim import build_optimizer
from infir2.model import prepare_for_training
from infir2.train.config import OptimConfig

ONE = DistEnv(0, 1, torch.device("cpu"), False)
Usage = namedtuple("Usage", "total used free")


def _state(n: int = 1 << 16) -> dict:
    return {
        "model": {"w": torch.arange(n, dtype=torch.float32)},
        "optimizer": {"state": {}},
        "scheduler": {"step": 1},
        "data": [None],
        "train_state": {"world_size": 1},
    }


def _with_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(space_module.shutil, "disk_usage", lambda _p: Usage(free, 0, free))


def _only_the_first(root: Path) -> None:
    """The step-1 checkpoint verifies, nothing else (no step 2, no temporary folder) is left."""
    assert [p.name for p in list_checkpoints(root)] == ["step_00000001"]
    verify(root / "step_00000001")
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]


def test_a_save_without_room_refuses_before_writing(tmp_path: Path, monkeypatch) -> None:
    save_checkpoint(tmp_path, 1, _state())
    written = []
    _with_free(monkeypatch, 100_000)  # the state is 256 KiB
    with pytest.raises(InsufficientSpaceError) as e:
        save_checkpoint(tmp_path, 2, _state(), writer=lambda s, p: written.append(p))
    message = str(e.value)
    assert written == [] and len(message.splitlines()) == 1
    assert str(tmp_path) in message and "checkpoint step_00000002 needs" in message
    assert "100000 bytes) free" in message and f"{space_module._needed(1 << 18)} bytes" in message
    _only_the_first(tmp_path)


def test_enospc_while_writing_is_one_clear_line_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, _state())

    def fills_the_disk(state: dict, path: Path) -> None:
        path.write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    with pytest.raises(InsufficientSpaceError, match=r"not enough disk space in .*No space left on device"):
        save_checkpoint(tmp_path, 2, _state(), writer=fills_the_disk)
    _only_the_first(tmp_path)


def test_another_write_error_is_not_called_a_full_disk(tmp_path: Path) -> None:
    def fails(state: dict, path: Path) -> None:
        raise RuntimeError("a bug, not the disk")

    with pytest.raises(RuntimeError, match="a bug, not the disk"):
        save_checkpoint(tmp_path, 1, _state(), writer=fails)
    assert list(tmp_path.iterdir()) == []  # the partial folder is removed


def test_torch_zip_writer_error_on_a_full_disk_is_recognised(tmp_path: Path, monkeypatch) -> None:
    """torch's writer reports a full disk as ``RuntimeError: ... unexpected pos``: no errno, so the free
    space after the failure decides."""
    save_checkpoint(tmp_path, 1, _state())

    def zip_writer_fails(state: dict, path: Path) -> None:
        _with_free(monkeypatch, 1000)  # what is left once the write has filled the disk
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    with pytest.raises(InsufficientSpaceError, match="unexpected pos"):
        save_checkpoint(tmp_path, 2, _state(), writer=zip_writer_fails)
    _only_the_first(tmp_path)


def _trained():
    torch.manual_seed(0)
    model = prepare_for_training(make_tiny_model(hidden=64, layers=1), "bf16")
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    ids = torch.randint(0, 300, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


def test_save_bytes_before_the_first_step_is_what_a_full_save_writes(tmp_path: Path) -> None:
    model = prepare_for_training(make_tiny_model(hidden=64, layers=1), "bf16")
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    predicted = save_bytes(model, optimizer)  # no optimizer state yet
    n = sum(p.numel() for p in model.parameters())
    assert predicted == 12 * n + 4 * len(list(model.parameters()))  # fp32 masters + 2 moments + step
    ids = torch.randint(0, 300, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert save_bytes(model, optimizer) == predicted  # the state AdamW made is what was predicted
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, tmp_path / "state.pt")
    written = (tmp_path / "state.pt").stat().st_size  # + pickle and zip headers, within the margin
    assert 0.97 < predicted / written < 1.0 and space_module._needed(predicted) > written


@pytest.mark.parametrize("async_save", [False, True])
def test_sharded_save_checks_the_room_and_translates_a_full_disk(
    tmp_path: Path, monkeypatch, async_save: bool
) -> None:
    model, optimizer = _trained()
    extra = {"scheduler": {"step": 1}, "train_state": {"step": 1}, "data": None, "rng": None}
    save_sharded(tmp_path, 1, model, optimizer, extra, ONE).wait()
    with monkeypatch.context() as m:
        _with_free(m, 10_000)
        with pytest.raises(InsufficientSpaceError, match="checkpoint step_00000002 needs"):
            save_sharded(tmp_path, 2, model, optimizer, extra, ONE, async_save=async_save)
    _only_the_first(tmp_path)
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def fills_the_disk(state, checkpoint_id, **kw):
        real_save(state, checkpoint_id=checkpoint_id, **kw)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dcp, "save", fills_the_disk)
    if async_save:  # the background write fails: wait() says so, in the same words
        monkeypatch.setattr(dcp, "async_save", lambda *a, **kw: _failed_future())
    with pytest.raises(InsufficientSpaceError, match="No space left on device"):
        save_sharded(tmp_path, 2, model, optimizer, extra, ONE, async_save=async_save).wait()
    _only_the_first(tmp_path)


def _failed_future():
    from concurrent.futures import Future

    f: Future = Future()
    f.set_exception(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    return f


def test_sharded_checkpoint_stores_a_tied_embedding_once(tmp_path: Path) -> None:
    def tied_model(seed: int):
        tiny = make_tiny_model(
            vocab_size=4096, hidden=64, layers=1, seed=seed, intermediate=128, max_positions=None, tie=True
        )
        model = prepare_for_training(tiny, "bf16")
        return model, build_optimizer(model, OptimConfig(lr=1e-2))

    model, optimizer = tied_model(0)
    ids = torch.randint(0, 4096, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    extra = {"scheduler": {"step": 1}, "train_state": {"step": 1}, "data": None, "rng": None}
    folder = save_sharded(tmp_path, 1, model, optimizer, extra, ONE).wait()
    written = sum(p.stat().st_size for p in folder.glob("*.distcp"))
    embedding = model.lm_head.weight.numel() * 4
    assert written < save_bytes(model, optimizer) + embedding // 2  # the 1 MiB embedding once, not twice
    other, other_optimizer = tied_model(1)
    load_sharded(folder, other, other_optimizer, ONE)
    assert other.lm_head.weight is other.model.embed_tokens.weight  # still tied
    assert torch.equal(other.lm_head.weight, model.lm_head.weight)
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)


def test_check_room_for_saves_refuses_a_run_that_cannot_save(tmp_path: Path, monkeypatch, caplog) -> None:
    model = prepare_for_training(make_tiny_model(hidden=64, layers=1), "bf16")
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    one = save_bytes(model, optimizer)
    _with_free(monkeypatch, one // 2)
    with pytest.raises(InsufficientSpaceError, match=r"checkpoints: the first checkpoint needs"):
        check_room_for_saves(tmp_path / "run", model, optimizer, keep_last=3)
    assert not (tmp_path / "run").exists()  # nothing made
    _with_free(monkeypatch, space_module._needed(one))  # room for one save, not for keep_last + 1 = 4
    with caplog.at_level("WARNING", logger="infir2.checkpoint"):
        assert check_room_for_saves(tmp_path / "run", model, optimizer, keep_last=3) == one
    assert "not for 4 more" in caplog.text
    caplog.clear()
    _with_free(monkeypatch, 4 * space_module._needed(one))
    check_room_for_saves(tmp_path / "run", model, optimizer, keep_last=3)
    assert caplog.text == ""


@contextlib.contextmanager
def _tiny_filesystem(path: Path, size: str):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        gc.collect()
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def test_a_real_full_disk(tmp_path: Path, monkeypatch) -> None:
    """A 4 MiB tmpfs: the check refuses a 4 MiB save; with the check fooled, the write itself fails
    (torch's ``unexpected pos``) and is reported as a full disk; the 256 KiB checkpoint survives both."""
    with _tiny_filesystem(tmp_path / "disk", "4m") as disk:
        root = disk / "checkpoints"
        save_checkpoint(root, 1, _state())
        with pytest.raises(InsufficientSpaceError, match="checkpoint step_00000002 needs"):
            save_checkpoint(root, 2, _state(1 << 20))
        _only_the_first(root)
        monkeypatch.setattr(full_module, "require_free_space", lambda *a, **kw: None)
        with pytest.raises(InsufficientSpaceError, match="the write failed") as e:
            save_checkpoint(root, 2, _state(1 << 20))
        message = str(e.value)
        del e  # its traceback holds torch's writer, whose open file keeps the tmpfs busy
        gc.collect()
        assert len(message.splitlines()) == 1 and "unexpected pos" in message
        _only_the_first(root)
        assert latest_checkpoint(root) == root / "step_00000001"


def test_infir2_train_on_a_full_disk_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    import yaml

    from infir2.cli import main
    from train_synthetic import prepared_cpt

    tok_dir, _ = prepared_cpt(tmp_path)
    tiny = {"arch": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    config = {
        "run": {"name": "full-disk", "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "model": {"from_config": tiny | {"num_attention_heads": 2, "num_key_value_heads": 1}},
        "data": {"kind": "cpt", "train_path": str(tmp_path / "cpt"), "seq_len": 16, "global_batch_size": 2},
        "train": {"max_steps": 1},
    }
    config["model"] |= {"tokenizer": str(tok_dir), "precision": "fp32"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    _with_free(monkeypatch, 1000)
    capsys.readouterr()
    assert main(["train", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("infir2 train: error: not enough disk space in") and len(err.splitlines()) == 1
    assert f"{tmp_path / 'runs' / 'full-disk' / 'checkpoints'}: the first checkpoint needs" in err
    assert not list((tmp_path / "runs").glob("*/checkpoints/step_*"))


def test_loading_a_full_checkpoint_takes_no_initializing_step(tmp_path: Path, monkeypatch) -> None:
    """A resumed process must not peak above the run it resumes: loading into a fresh optimizer makes
    no zero-gradient step (gradients, moments and AdamW's temporaries beside the loading state), and
    the loaded state is exact."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from infir2.checkpoint import load_full

    model, optimizer = _trained()
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    state = {
        "model": msd,
        "optimizer": osd,
        "scheduler": {},
        "data": [None],
        "train_state": {"world_size": 1},
    }
    folder = save_checkpoint(tmp_path, 1, state)
    other = prepare_for_training(make_tiny_model(hidden=64, layers=1, seed=1), "bf16")
    other_optimizer = build_optimizer(other, OptimConfig(lr=1e-2))
    steps = []
    monkeypatch.setattr(other_optimizer, "step", lambda *a, **kw: steps.append(1))
    load_full(folder, other, other_optimizer)
    assert steps == [] and all(p.grad is None for p in other.parameters())
    names = dict(zip(other.parameters(), (n for n, _ in other.named_parameters()), strict=True))
    saved = {n: s for n, s in osd["state"].items()}
    assert {names[p] for p in other_optimizer.state} == set(saved)
    for p, s in other_optimizer.state.items():
        assert s.keys() == saved[names[p]].keys()
        assert all(torch.equal(v, saved[names[p]][k]) for k, v in s.items())
