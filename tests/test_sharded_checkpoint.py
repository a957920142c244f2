"""Sharded (DCP) checkpoints: exact model and AdamW state after a reload, on the same or another
number of ranks; atomic folders; per-tensor reading for the export; data positions across world sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from conftest import make_tiny_model
from infir2.checkpoint import (
    is_sharded_checkpoint,
    iter_model_tensors,
    list_sharded,
    load_sharded,
    save_sharded,
)
from infir2.harness.distributed import DistEnv
from infir2.harness.optim import build_optimizer
from infir2.harness.resume import data_state_for
from infir2.model import prepare_for_training
from infir2.train.config import OptimConfig
from train_synthetic import torchrun

TESTS = Path(__file__).parent
ONE = DistEnv(0, 1, torch.device("cpu"), False)


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = prepare_for_training(make_tiny_model(hidden=64, layers=1, seed=seed), "blockwise")
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    ids = torch.randint(0, 300, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


def _assert_same_state(a, b):
    (ma, oa), (mb, ob) = get_state_dict(*a), get_state_dict(*b)
    assert ma.keys() == mb.keys()
    for key in ma:
        assert torch.equal(ma[key], mb[key]), key
    for name, moments in oa["state"].items():
        for k, v in moments.items():
            assert torch.equal(ob["state"][name][k], v), (name, k)


@pytest.mark.parametrize("async_save", [False, True])
def test_save_load_one_process_is_exact(tmp_path, async_save):
    model, optimizer = _trained()
    extra = {"scheduler": {"step": 1}, "train_state": {"step": 1}, "data": {"step": 1}, "rng": None}
    pending = save_sharded(tmp_path, 1, model, optimizer, extra, ONE, async_save=async_save)
    before = model.lm_head.weight.detach().clone()
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # training goes on while an async save writes: it saved the old value
    path = pending.wait()
    with torch.no_grad():
        model.lm_head.weight.copy_(before)
    assert path == tmp_path / "step_00000001" and is_sharded_checkpoint(path)
    fresh = _trained(seed=1)
    assert not torch.equal(fresh[0].lm_head.weight, model.lm_head.weight)
    loaded = load_sharded(path, *fresh, ONE)
    _assert_same_state((model, optimizer), fresh)
    assert loaded["train_state"] == {"step": 1, "world_size": 1} and loaded["data"] == [{"step": 1}]
    full = model.state_dict()
    names = [name for name, tensor in iter_model_tensors(path) if torch.equal(tensor, full[name])]
    assert sorted(names) == sorted(full)


def test_interrupted_save_keeps_previous(tmp_path):
    model, optimizer = _trained()
    extra = {"train_state": {}}
    good = save_sharded(tmp_path, 1, model, optimizer, extra, ONE).wait()
    # a save killed before its rename leaves a .tmp folder: ignored, and removed by the next save
    (tmp_path / ".tmp-step_00000002").mkdir()
    (tmp_path / ".tmp-step_00000002" / "__0_0.distcp").write_bytes(b"partial")
    assert list_sharded(tmp_path) == [good]
    # a damaged file no longer matches meta.json: the folder is not a checkpoint
    copy = tmp_path / "step_00000003"
    save_sharded(tmp_path, 3, model, optimizer, extra, ONE, keep_last=5).wait()
    assert not (tmp_path / ".tmp-step_00000002").exists()
    with open(copy / "__0_0.distcp", "r+b") as f:
        f.truncate(10)
    assert list_sharded(tmp_path) == [good]
    with pytest.raises(ValueError, match="truncated or incomplete"):
        load_sharded(copy, model, optimizer, ONE)


def test_data_state_across_world_sizes():
    same = {"data": [{"step": 4}, {"step": 4}], "train_state": {"world_size": 2}}
    assert data_state_for(same, DistEnv(1, 2, torch.device("cpu"), False)) == {"step": 4}
    assert data_state_for(same, ONE) == {"step": 4}  # a global position: the same global sample count
    differ = {"data": [{"i": 0}, {"i": 1}], "train_state": {"world_size": 2}}
    assert data_state_for(differ, DistEnv(1, 2, torch.device("cpu"), False)) == {"i": 1}
    with pytest.raises(ValueError, match="differ by rank"):
        data_state_for(differ, ONE)


@pytest.mark.slow
def test_two_ranks_save_one_process_loads(tmp_path):
    """2 FSDP2 ranks (FP8 all-gather on) save asynchronously and reload on 2 ranks (checked in the
    worker); one process then loads the same folder: model and optimizer exactly as gathered at save."""
    from fsdp_param_gather_worker import tiny_qwen2

    torchrun(str(TESTS / "sharded_checkpoint_worker.py"), str(tmp_path), "async")
    ref = torch.load(tmp_path / "full.pt", weights_only=False)
    model = prepare_for_training(tiny_qwen2(seed=9), "blockwise")
    optimizer = build_optimizer(model, OptimConfig(lr=3e-3))
    extra = load_sharded(tmp_path / "ckpt" / "step_00000002", model, optimizer, ONE)
    assert extra["train_state"]["world_size"] == 2 and data_state_for(extra, ONE) == {"step": 2}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    for key, value in ref["model"].items():
        assert torch.equal(model_sd[key], value), key
    for name, moments in ref["optimizer"]["state"].items():
        for k, v in moments.items():
            assert torch.equal(optim_sd["state"][name][k], v), (name, k)


def test_streaming_hf_export_from_sharded(tmp_path):
    """The export path the end of a run can take: one full tensor at a time into safetensors shards."""
    from infir2.export.shards import CheckpointReader, ShardWriter

    model, optimizer = _trained()
    path = save_sharded(tmp_path / "ckpt", 1, model, optimizer, {"train_state": {}}, ONE).wait()
    writer = ShardWriter(tmp_path / "hf", max_shard_bytes="100KB")
    for name, tensor in iter_model_tensors(path, dtype=torch.bfloat16):
        writer.add(name, tensor)
    index = writer.close()
    assert len(set(index["weight_map"].values())) > 1
    reader = CheckpointReader(tmp_path / "hf")
    for name, value in model.state_dict().items():
        assert torch.equal(reader.get(name), value.to(torch.bfloat16)), name
