"""Configs without reading source: shipped configs by name from any folder, every key with its default and
meaning, and the whole config checked before a model is built."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from infir2.cli import main
from infir2.harness.config import shipped_configs
from infir2.rl.config import RLConfig, load_rl_config
from infir2.train import config as config_module
from infir2.train.config import RunConfig, load_config


def test_shipped_configs_load_by_name_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no src/infir2/configs here, as after `pip install`
    assert {"tiny-cpt", "tiny-sft", "qwen2.5-7b-cpt"} <= set(shipped_configs())
    for name in ("tiny-cpt", "tiny-cpt.yaml", "src/infir2/configs/tiny-cpt.yaml"):
        assert load_config(name).run.name == "tiny-cpt"
    with pytest.raises(FileNotFoundError, match=r"neither a file nor a shipped config .*tiny-cpt"):
        load_config("tiny-cpx")
    (tmp_path / "own").mkdir()
    with pytest.raises(FileNotFoundError):  # a path elsewhere is never taken for a shipped name
        load_config("own/tiny-cpt.yaml")
    assert load_rl_config("qwen2.5-7b-rl").rollout.max_new_tokens == 8192  # RL configs by name alike


def test_config_reads_the_stage_from_the_sections(capsys):
    assert main(["config", "qwen2.5-7b-rl", "--set", "algo.kl_coef=0.01"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["algo"]["kl_coef"] == 0.01 and resolved["rollout"]["group_size"] == 16
    assert resolved == yaml.safe_load(
        yaml.safe_dump(dataclasses.asdict(load_rl_config("qwen2.5-7b-rl", ["algo.kl_coef=0.01"])))
    )
    assert main(["config", "--list"]) == 0
    listed = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert listed["qwen2.5-7b-rl"] == "rl" and listed["tiny-cpt"] == "train" and listed["tiny-sft"] == "train"
    assert main(["config", "--keys"]) == 0  # both stages, each under its heading
    out = capsys.readouterr().out
    assert "# infir2 train" in out and "# infir2 rl" in out and "rollout:" in out and "schedule:" in out
    assert main(["config", "qwen2.5-7b-rl", "--set", "rollout.group_size=1"]) == 2
    assert "rollout.group_size" in capsys.readouterr().err


@pytest.mark.parametrize(("stage", "cfg"), [("train", RunConfig()), ("rl", RLConfig())])
def test_every_key_is_printed_with_its_default_and_meaning(capsys, stage, cfg):
    assert main(["config", "--keys", "--stage", stage]) == 0
    printed = yaml.safe_load(capsys.readouterr().out.replace("\n      ", "\n  # "))  # meanings as comments
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            assert f.metadata.get("help"), f"{section.name}.{f.name} has no meaning"
            shown = printed[section.name][f.name]
            assert shown == (list(f.default) if isinstance(f.default, tuple) else f.default), f.name


def test_the_whole_config_is_checked_before_a_model_is_built(tmp_path, monkeypatch, capsys):
    from conftest import make_tiny_model, make_tokenizer

    folder = tmp_path / "model"
    make_tiny_model("llama").save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
        )
        + "\n"
    )
    cfg = {
        "run": {"out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "model": {"path": str(folder)},
        "data": {"kind": "sft", "train_path": str(chats)},
    }
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(cfg))

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the config was checked")

    monkeypatch.setattr("infir2.harness.setup.load_pretrained", no_model)
    monkeypatch.setattr("infir2.harness.setup.build_from_config", no_model)
    assert main(["train", str(tmp_path / "sft.yaml"), "--no-progress"]) == 2
    assert "data.max_tokens_per_micro_batch: required for SFT" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                str(tmp_path / "sft.yaml"),
                "--set",
                "data.max_tokens_per_micro_batch=64",
                "--set",
                "data.max_length=64",
                "--set",
                "data.val_path=missing.jsonl",
            ]
        )
        == 2
    )
    assert "data.val_path: SFT data file missing.jsonl does not exist" in capsys.readouterr().err
    cfg["data"] = {"kind": "cpt", "train_path": str(tmp_path / "nowhere")}
    (tmp_path / "cpt.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["config", str(tmp_path / "cpt.yaml")]) == 2  # the same checks, without training
    assert "data.train_path: " in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    assert config_module.key_reference()[0] == ("run.name", "run", "the run folder is <out_dir>/<name>")


def test_an_sft_validation_file_smaller_than_one_batch_is_refused(tmp_path, capsys):
    """It would give no validation step (val_loss nan); said before the first training step."""
    from conftest import make_tiny_model, make_tokenizer

    folder = tmp_path / "model"
    make_tiny_model("llama").save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (tmp_path / "train.jsonl").write_text(json.dumps(chat) + "\n" * 1 + json.dumps(chat) + "\n")
    (tmp_path / "val.jsonl").write_text(json.dumps(chat) + "\n")
    cfg = {
        "run": {"out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "model": {"path": str(folder)},
        "data": {
            "kind": "sft",
            "train_path": str(tmp_path / "train.jsonl"),
            "val_path": str(tmp_path / "val.jsonl"),
            "global_batch_size": 2,
            "max_tokens_per_micro_batch": 64,
            "max_length": 64,
        },
    }
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(tmp_path / "sft.yaml"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"data.val_path: {tmp_path / 'val.jsonl'}: " in err and "fewer than global_batch_size=2" in err
    assert not (tmp_path / "runs" / "run" / "metrics.jsonl").exists()
