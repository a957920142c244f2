"""The tiny configs run as shipped: `infir2 demo --data-only --out runs/tiny` writes what they read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import infir2
from infir2.cli import main
from train_synthetic import one_thread

_one_thread = pytest.fixture(autouse=True)(one_thread)

CONFIGS = Path(infir2.__file__).parent / "configs"


def _paths_read_by(config: Path) -> list[str]:
    cfg = yaml.safe_load(config.read_text())
    return [
        p
        for p in (cfg["model"].get("tokenizer"), cfg["data"]["train_path"], cfg["data"].get("val_path"))
        if p
    ]


def test_missing_tokenizer_says_how_to_get_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(CONFIGS / "tiny-cpt.yaml"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer folder not found: runs/tiny/tokenizer" in err and "infir2 demo --data-only" in err


def test_data_only_then_tiny_cpt_then_tiny_sft_run_as_shipped(tmp_path, monkeypatch):
    """~10 s: the data, then two steps of each config, unchanged but for the step count and device."""
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--data-only", "--quick", "--out", "runs/tiny"]) == 0
    for name in ("tiny-cpt.yaml", "tiny-sft.yaml"):
        assert "infir2 demo --data-only --out runs/tiny" in (CONFIGS / name).read_text()  # the header says so
        for path in _paths_read_by(CONFIGS / name):
            assert (tmp_path / path).exists(), f"{name} reads {path}, which --data-only did not write"
    assert not (tmp_path / "runs/tiny/runs").exists()  # data only: no training
    short = ["--no-progress", "--set", "train.max_steps=2", "--set", "run.device=cpu"]
    assert main(["train", str(CONFIGS / "tiny-cpt.yaml"), *short]) == 0
    assert (tmp_path / "runs/tiny-cpt/hf/config.json").is_file()
    assert main(["train", str(CONFIGS / "tiny-sft.yaml"), *short]) == 0
    rows = (tmp_path / "runs/tiny-sft/metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2]
