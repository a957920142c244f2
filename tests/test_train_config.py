"""Run configs: every shipped config loads; bad input names the key and the file; overrides are typed."""

from __future__ import annotations

from pathlib import Path

import pytest

import infir2
from infir2.fp8 import RECIPES
from infir2.harness import config as config_module
from infir2.train.config import RunConfig, load_config, parse_config, save_config

CONFIG_DIR = Path(infir2.__file__).parent / "configs"
SHIPPED = sorted(p for p in CONFIG_DIR.glob("*.yaml") if "rl" not in p.stem.split("-"))  # rl: its own schema


def test_configs_are_shipped():
    names = {p.stem for p in SHIPPED}
    for size in ("1.5b", "7b"):
        for kind in ("cpt", "sft-stage1", "sft-stage2", "decay-only"):
            assert f"qwen2.5-{size}-{kind}" in names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_config_loads_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_authors_hyperparameters_are_expressed():
    cpt = load_config(CONFIG_DIR / "qwen2.5-7b-cpt.yaml")
    assert (cpt.data.seq_len, cpt.data.global_batch_size, cpt.train.max_steps) == (32768, 128, 40000)
    assert (cpt.optim.lr, cpt.schedule.min_lr, cpt.optim.betas) == (1e-4, 1e-5, (0.9, 0.95))
    assert (cpt.optim.weight_decay, cpt.optim.grad_clip) == (0.1, 1.0)
    assert (cpt.schedule.name, cpt.schedule.warmup_steps, cpt.schedule.decay_steps) == ("wsd", 5000, 5000)
    for size, lr in (("7b", 2e-5), ("1.5b", 5e-5)):
        sft = load_config(CONFIG_DIR / f"qwen2.5-{size}-sft-stage1.yaml")
        assert (sft.optim.lr, sft.schedule.name, sft.schedule.min_lr_ratio) == (lr, "cosine", 0.1)
        assert (sft.schedule.warmup_fraction, sft.optim.weight_decay, sft.data.global_batch_size) == (
            0.05,
            0.0,
            64,
        )
        assert (sft.data.epochs, sft.data.max_length, sft.data.kind) == (5, 32768, "sft")
    decay = load_config(CONFIG_DIR / "qwen2.5-7b-decay-only.yaml")
    assert decay.load.mode == "decay_only" and decay.load.path


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  path: some/model\ndata:\n  train_path: data/cpt\n" + text)
    return path


@pytest.mark.parametrize(
    ("text", "key", "what"),
    [
        ("optim:\n  lrr: 1.0\n", "optim.lrr", "unknown key"),
        ("optimizer:\n  lr: 1.0\n", "optimizer", "unknown key"),
        ("optim:\n  lr: fast\n", "optim.lr", "expected a number"),
        ("train:\n  max_steps: 1.5\n", "train.max_steps", "expected an integer"),
        ("data:\n  shuffle: maybe\n", "data.shuffle", "expected true or false"),
        ("schedule:\n  name: linear\n", "schedule.name", "expected one of"),
        ("fp8:\n  recipe: fp4\n", "fp8.recipe", "known recipes"),
        ("optim:\n  betas: [0.9]\n", "optim.betas", "list of 2"),
        ("optim:\n  lr: -1.0\n", "optim.lr", "> 0"),
        ("optim:\n  lr: 0.0\n", "optim.lr", "> 0"),
        ("optim:\n  lr: .nan\n", "optim.lr", "finite"),
        ("optim:\n  lr: .inf\n", "optim.lr", "finite"),
        ("optim:\n  lr: 1e39\n", "optim.lr", "overflows float32"),
        ("schedule:\n  warmup_steps: 5\n  warmup_fraction: 0.1\n", "schedule.warmup_steps", "not both"),
        ("train:\n  checkpoint_format: sharded\n", "train.checkpoint_format", "expected one of"),
        ("train:\n  checkpoint_format: full\n  async_save: true\n", "train.async_save", "format: dcp"),
    ],
)
def test_bad_config_names_key_and_file(tmp_path, text, key, what):
    path = _write(tmp_path, text)
    if text.startswith("data:"):  # replace, not duplicate, the data section
        path.write_text("model:\n  path: m\n" + text + "  train_path: d\n")
    with pytest.raises(ValueError) as e:
        load_config(path)
    message = str(e.value)
    assert str(path) in message and key in message and what in message, message


def test_overrides_are_typed_by_the_field(tmp_path):
    path = _write(tmp_path, "optim:\n  lr: 1.0e-4\n")
    cfg = load_config(
        path,
        [
            "optim.lr=3e-4",
            "data.shuffle=false",
            "optim.betas=[0.8,0.9]",
            "train.max_steps=7",
            "fp8.recipe=bf16",
            "load.path=ckpt/step_00000010",
        ],
    )
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.data.shuffle is False and cfg.optim.betas == (0.8, 0.9) and cfg.train.max_steps == 7
    assert cfg.fp8.recipe == "bf16" and cfg.load.path == "ckpt/step_00000010"
    with pytest.raises(ValueError, match=r"optim\.lrr.*unknown key"):
        load_config(path, ["optim.lrr=1"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        load_config(path, ["optim.lr"])


def test_pyyaml_exponent_without_dot_is_a_float(tmp_path):
    # PyYAML (YAML 1.1) reads `1e-4` as a string; a float field still accepts it
    assert load_config(_write(tmp_path, "optim:\n  lr: 1e-4\n")).optim.lr == 1e-4


def _accepts_recipe(name: str) -> bool:
    try:
        parse_config({"fp8": {"recipe": name}}, "<test>")
    except ValueError as e:
        assert "<test>: fp8.recipe" in str(e) and all(known in str(e) for known in RECIPES), e
        return False
    return True


def test_config_recipe_names_are_exactly_the_registry(monkeypatch):
    """fp8.recipe accepts every RECIPES key and nothing else; a recipe added to the registry needs no config edit."""
    assert all(_accepts_recipe(name) for name in RECIPES)
    assert not any(_accepts_recipe(name) for name in ("fp4", "Blockwise", "", "blockwise "))
    monkeypatch.setitem(RECIPES, "planted_recipe", next(iter(RECIPES.values())))
    assert config_module.RECIPES is RECIPES and _accepts_recipe("planted_recipe")
