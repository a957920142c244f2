"""Weights are written with the same permissions as every other file (safetensors alone makes them 0600)."""

from __future__ import annotations

import stat

import torch

from conftest import make_tiny_model
from infir2.export import export_model
from infir2.export.shards import ShardWriter


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_shards_and_hf_export_match_a_plain_file(tmp_path):
    reference = tmp_path / "plain.txt"
    reference.write_text("x")  # what open() gives under this umask
    writer = ShardWriter(tmp_path / "shards", max_shard_bytes=64)
    for i in range(3):
        writer.add(f"t{i}", torch.zeros(16))
    writer.close()
    model = make_tiny_model()
    export_model(model, None, tmp_path / "hf")  # the writer behind infir2 export and every run's <run>/hf
    written = [*(tmp_path / "shards").iterdir(), *(tmp_path / "hf").iterdir()]
    assert any(p.suffix == ".safetensors" for p in written)
    assert {p.name: _mode(p) for p in written} == {p.name: _mode(reference) for p in written}
