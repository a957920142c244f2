"""Checkpoints written by earlier, unreleased versions of infir2: refused in one line naming the folder.

``tests/fixtures/checkpoints_v1/`` holds one ``full`` and one ``dcp`` checkpoint of the same tiny run
(a 1-layer Qwen2 of width 32, recipe ``bf16``, fp32 masters, 2 of 4 optimizer steps done), written by
the code before the checkpoint package (``infir2.checkpoint`` as one module, its ``meta.json`` with
``state_bytes`` / ``state_sha256``; ``infir2.train.sharded_checkpoint``), whose counters were still
``nonfinite_total`` / ``nonfinite_in_row``. No release has written those layouts, so every reader refuses
them (CONTRIBUTING.md, "Layouts no release has written"): the ``full`` one at its ``meta.json``, the
``dcp`` one (whose ``meta.json`` is today's) at its counters. Neither is damaged: neither is skipped for
an older checkpoint nor set aside by ``start_fresh``. The fixture is data from the past: do not
regenerate it with today's code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model
from infir2 import checkpoint as ckpt
from infir2.train import train
from train_synthetic import SyntheticSource, checkpoint_state, one_thread, tiny_run_config

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoints_v1"
FORMATS = ("full", "dcp")
SAVED_STEP, STEPS = 2, 4
NOT_READ = "a layout this version does not read"
#: what each fixture's refusal names after its folder
PROBLEM = {
    "full": "meta.json has no format, files (it holds state_bytes, state_sha256, step, world_size)",
    "dcp": "train_state holds the counters nonfinite_in_row, nonfinite_total, step, tokens_seen; "
    "TrainState has skipped_in_row, skipped_total, step, tokens_seen",
}
_one_thread = pytest.fixture(autouse=True)(one_thread)


def _model() -> torch.nn.Module:
    """The model the fixture was written with (keep it: the saved weights are this model's)."""
    return make_tiny_model(vocab_size=64, hidden=32, layers=1, intermediate=64, max_positions=64)


def _config(out_dir: Path, fmt: str, start_fresh: bool = False):
    return tiny_run_config(
        out_dir,
        fmt,
        fp8={"recipe": "bf16"},
        train={"max_steps": STEPS, "save_every": SAVED_STEP, "checkpoint_format": fmt},
        load={"start_fresh": start_fresh},
    )


def _source() -> SyntheticSource:
    return SyntheticSource(vocab_size=64, seq_len=16, seed=5)


def _step_folder(fmt: str) -> Path:
    return FIXTURE / fmt / f"step_{SAVED_STEP:08d}"


@pytest.mark.parametrize("start_fresh", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_checkpoint_of_an_unreleased_layout_is_refused_in_one_line(tmp_path, fmt, start_fresh):
    """The ``full`` one's ``meta.json`` predates the ``files`` map, the ``dcp`` one's counters the names
    ``skipped_*``: no release wrote either, so neither is translated, and ``--start-fresh`` does not set
    them aside as damaged."""
    cfg = _config(tmp_path, fmt, start_fresh)
    (cfg.run_dir / "checkpoints").mkdir(parents=True)
    step = cfg.run_dir / "checkpoints" / _step_folder(fmt).name
    shutil.copytree(_step_folder(fmt), step)
    with pytest.raises(ValueError) as e:
        train(cfg, model=_model(), train_source=_source(), progress=False)
    assert isinstance(e.value, ckpt.OlderLayoutError)
    assert str(e.value) == f"checkpoint {step}: {PROBLEM[fmt]}: {ckpt.NO_OLDER_LAYOUTS}"
    assert NOT_READ in str(e.value) and "\n" not in str(e.value)
    assert [p.name for p in step.parent.iterdir()] == [step.name]  # kept, and no step trained


def test_every_reader_refuses_the_meta_json_before_the_files_map():
    """Verifying, listing, loading, the newest loadable: each refuses (or does not list) the old ``full``
    checkpoint, whose ``state.pt`` is intact (the size and SHA-256 its ``meta.json`` records)."""
    folder = _step_folder("full")
    expected = f"checkpoint {folder}: {PROBLEM['full']}: {ckpt.NO_OLDER_LAYOUTS}"
    for read in (ckpt.read_meta, ckpt.verify, ckpt.load_checkpoint, ckpt.verify_sharded):
        with pytest.raises(ckpt.OlderLayoutError) as e:
            read(folder)
        assert str(e.value) == expected, read.__name__
    assert ckpt.list_checkpoints(folder.parent) == [] and not ckpt.is_sharded_folder(folder)
    old = json.loads((folder / "meta.json").read_text())
    assert old["state_sha256"] == ckpt.sha256_file(folder / "state.pt")  # refused for its layout alone


def test_a_file_recorded_without_a_checksum_is_refused(tmp_path):
    """A ``files`` entry without ``sha256`` is not loaded unverified: the checkpoint is refused."""
    folder = tmp_path / _step_folder("dcp").name
    shutil.copytree(_step_folder("dcp"), folder)
    ckpt.verify(folder, "dcp")  # today's meta.json layout: it verifies
    meta = json.loads((folder / "meta.json").read_text())
    del meta["files"]["extra.pt"]["sha256"]
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.OlderLayoutError) as e:
        ckpt.verify(folder, "dcp")
    assert (
        str(e.value)
        == f"checkpoint {folder}: meta.json records no sha256 for extra.pt: {ckpt.NO_OLDER_LAYOUTS}"
    )


@pytest.mark.parametrize("start_fresh", [False, True])
def test_the_newest_loadable_stops_at_an_older_layout(tmp_path, start_fresh):
    """A damaged checkpoint is skipped for the next older one; one of an older layout is not damaged, so
    the walk stops there (resuming behind it would lose its steps) and nothing is set aside."""
    root = tmp_path / "checkpoints"
    ckpt.save_checkpoint(root, 1, checkpoint_state(1))
    shutil.copytree(_step_folder("full"), root / _step_folder("full").name)  # step 2: the older layout
    with pytest.raises(ckpt.OlderLayoutError, match=NOT_READ):
        ckpt.load_latest_valid(root, start_fresh)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]
    (root / "step_00000002" / "meta.json").write_text("{")  # damaged instead: skipped for step 1
    found = ckpt.load_latest_valid(root, start_fresh)
    assert found is not None and found[0].name == "step_00000001" and found[1]["scheduler"] == {"step": 1}


def test_a_meta_json_without_a_step_is_damage_not_an_older_layout(tmp_path):
    """Every layout recorded the step: a mapping without it is damaged (skipped, the next older one
    loads), not refused as a layout."""
    root = tmp_path / "checkpoints"
    ckpt.save_checkpoint(root, 1, checkpoint_state(1))
    ckpt.save_checkpoint(root, 2, checkpoint_state(2))
    (root / "step_00000002" / "meta.json").write_text("{}")
    with pytest.raises(ValueError, match=r"unreadable meta\.json") as e:
        ckpt.read_meta(root / "step_00000002")
    assert not isinstance(e.value, ckpt.OlderLayoutError)
    found = ckpt.load_latest_valid(root)
    assert found is not None and found[0].name == "step_00000001"
