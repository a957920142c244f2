"""Resuming with a changed config: meaningful changes refused (listed), accepted on request, old config kept."""

from __future__ import annotations

import pytest
import yaml

from conftest import make_tiny_model
from infir2.harness.config_changes import ConfigChangedError, config_changes
from infir2.train import train
from infir2.train.config import MEANINGFUL
from train_synthetic import SyntheticSource, one_thread, tiny_run_config

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _run(cfg):
    return train(cfg, model=make_tiny_model(), train_source=SyntheticSource(seed=1), progress=False)


def test_config_changes_are_classified():
    saved = {"train": {"max_steps": 2, "log_every": 1}, "model": {"from_config": {"arch": "qwen2", "n": 1}}}
    now = {"train": {"max_steps": 4, "log_every": 5}, "model": {"from_config": {"arch": "qwen2", "n": 2}}}
    meaningful, harmless = config_changes(saved, now, MEANINGFUL)
    assert meaningful == [
        "model.from_config: {'arch': 'qwen2', 'n': 1} -> {'arch': 'qwen2', 'n': 2}",
        "train.max_steps: 2 -> 4",
    ]
    assert harmless == ["train.log_every: 1 -> 5"]


def test_resume_with_a_changed_schedule_is_refused_unless_accepted(tmp_path):
    cfg = tiny_run_config(tmp_path, train={"max_steps": 2})
    _run(cfg)
    saved = (cfg.run_dir / "config.yaml").read_bytes()
    longer = tiny_run_config(tmp_path, train={"max_steps": 4}, optim={"lr": 1e-3})
    with pytest.raises(ConfigChangedError) as e:
        _run(longer)
    message = str(e.value)
    assert "train.max_steps: 2 -> 4" in message and "optim.lr: 0.003 -> 0.001" in message
    assert "\n" not in message and str(cfg.run_dir / "config.yaml") in message
    assert (cfg.run_dir / "config.yaml").read_bytes() == saved  # not overwritten

    accepted = tiny_run_config(
        tmp_path, train={"max_steps": 4}, optim={"lr": 1e-3}, run={"accept_config_changes": True}
    )
    result = _run(accepted)
    assert [m["step"] for m in result.history] == [3, 4]
    assert (cfg.run_dir / "config.2.yaml").read_bytes() == saved  # the old one kept, named by its step
    assert yaml.safe_load((cfg.run_dir / "config.yaml").read_text())["train"]["max_steps"] == 4


def test_harmless_changes_are_logged_and_resume(tmp_path, caplog):
    cfg = tiny_run_config(tmp_path, train={"max_steps": 2})
    _run(cfg)
    saved = (cfg.run_dir / "config.yaml").read_bytes()
    caplog.set_level("INFO")
    result = _run(tiny_run_config(tmp_path, train={"max_steps": 2, "log_every": 7, "keep_last": 3}))
    assert result.history == [] and result.step == 2
    assert "train.log_every: 1 -> 7" in caplog.text and "train.keep_last: 2 -> 3" in caplog.text
    assert (cfg.run_dir / "config.2.yaml").read_bytes() == saved
