"""`infir2 rl` on the run harness: what its copy of training had drifted on, each fixed once for both stages.

Each test failed on the RL loop before the harness: the CUDA RNG was not saved, the skip streak raised a
bare ``ValueError`` (no ``NonFiniteError``, no last checkpoint named) and had no guard that fits RL, the
tokenizer was read without the model type ``infir2 train`` reads it with, an fp64 run could not export,
and a refused input left a run folder holding only its lock.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import make_tiny_model
from infir2.cli import main
from infir2.data import load_tokenizer
from infir2.eval import GRADERS, Graded
from infir2.harness.guards import NonFiniteError
from infir2.rl import loop as rl_loop
from infir2.rl import parse_rl_config, rl
from infir2.rl import update as rl_update
from test_rl_loop import _config as rl_loop_config
from test_rl_loop import _prompts
from train_synthetic import one_thread

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

_one_thread = pytest.fixture(autouse=True)(one_thread)


@pytest.fixture(autouse=True)
def parity_reward(monkeypatch):
    monkeypatch.setitem(GRADERS, "parity", lambda problem, text: Graded(None, len(text) % 2 == 1))


def _config(tmp_path, name, **sections):
    """tests/test_rl_loop.py's tiny run, one step by default, every step saved."""
    base = {
        "rollout": {"max_new_tokens": 6, "carry_over": False},
        "algo": {"overlong": "none", "updates_per_batch": 1},
        "train": {"max_steps": 1, "save_every": 1},
    }
    merged = {k: {**base.get(k, {}), **sections.get(k, {})} for k in base.keys() | sections.keys()}
    return rl_loop_config(tmp_path, name, **merged)


def test_an_rl_checkpoint_holds_every_rng_the_cuda_one_included(tmp_path, tiny_tokenizer, monkeypatch):
    """The saved RNG state has the CUDA generators' states when CUDA exists (faked while the checkpoint is
    written: this is a CPU machine)."""
    fake = [torch.ByteTensor([1, 2, 3])]
    save = rl_loop.save

    def save_with_cuda(*args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)
            m.setattr(torch.cuda, "get_rng_state_all", lambda: fake)
            return save(*args, **kwargs)

    monkeypatch.setattr(rl_loop, "save", save_with_cuda)
    result = rl(
        _config(tmp_path, "rng"), model=make_tiny_model(seed=1), tokenizer=tiny_tokenizer, progress=False
    )
    saved = torch.load(result.checkpoint / "state.pt", weights_only=True)
    rng = saved["train_state"]["rng"]
    assert isinstance(rng, list) and set(rng[0]) == {"torch", "python", "cuda"}
    assert torch.equal(rng[0]["cuda"][0], fake[0])


def test_a_skip_streak_stops_rl_with_the_harness_error_naming_the_last_checkpoint(
    tmp_path, tiny_tokenizer, monkeypatch
):
    real, update = rl_update.policy_loss, rl_loop.update
    updates = {"n": 0}

    def count_updates(*args, **kwargs):
        updates["n"] += 1
        return update(*args, **kwargs)

    def nan_after_first_step(*args, **kwargs):
        total, stats = real(*args, **kwargs)
        return (total * float("nan") if updates["n"] > 1 else total), stats

    monkeypatch.setattr(rl_loop, "update", count_updates)
    monkeypatch.setattr(rl_update, "policy_loss", nan_after_first_step)
    cfg = _config(tmp_path, "nan", train={"max_steps": 5, "max_skipped_in_row": 2, "save_every": 1})
    with pytest.raises(NonFiniteError, match="step_00000001") as error:
        rl(cfg, model=make_tiny_model(seed=1), tokenizer=tiny_tokenizer, progress=False)
    assert "train.max_skipped_in_row=2" in str(error.value)
    steps = sorted(p.name for p in (tmp_path / "nan" / "checkpoints").glob("step_*"))
    assert steps == ["step_00000001"]  # nothing saved during the streak


def test_a_rollout_mismatch_above_the_gate_skips_the_updates(tmp_path, tiny_tokenizer):
    """High-precision rollouts of an FP8-trained policy differ from it by FP8 rounding: a gate just above a perfect
    match skips every update, the weights stay those of the start, and the streak stops the run."""
    cfg = _config(
        tmp_path,
        "gate",
        rollout={"precision": "high"},
        train={"max_steps": 3, "max_skipped_in_row": 2, "max_prob_error": 1.000001, "save_every": 0},
    )
    model = make_tiny_model(seed=1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteError, match="rollout mismatch"):
        rl(cfg, model=model, tokenizer=tiny_tokenizer, progress=False)
    lines = [json.loads(x) for x in (tmp_path / "gate" / "metrics.jsonl").read_text().splitlines()]
    assert [m["updates"] for m in lines] == [0, 0]
    assert all(m["mismatch/prob_error"] > 1.000001 and "rollout mismatch" in m["skipped"] for m in lines)
    for name, t in model.state_dict().items():
        assert torch.equal(t.to(start[name].dtype), start[name]), name
    # the same run without the gate trains
    ok = _config(
        tmp_path, "nogate", rollout={"precision": "high"}, train={"max_steps": 1, "max_prob_error": None}
    )
    assert (
        rl(ok, model=make_tiny_model(seed=1), tokenizer=tiny_tokenizer, progress=False).history[0]["updates"]
        == 1
    )


def test_rl_reads_its_tokenizer_as_infir2_train_does(tmp_path, tiny_tokenizer, monkeypatch):
    """A separate tokenizer folder is read for the model's type (the export's reading), not as its files say.

    The tiny tokenizer's folder is ambiguous: its tokenizer.json and what AutoTokenizer builds for a qwen2
    model split some text differently; RL must use the second, the one `infir2 train` used."""
    model_dir, tok_dir = tmp_path / "policy", tmp_path / "tok"
    make_tiny_model(seed=1).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(tok_dir)
    prompts = tmp_path / "odd.jsonl"
    text = "He said:\"hello\"... .net isn't it? DON'T! x=12+7*(3-4)"
    prompts.write_text(
        "".join(json.dumps({"problem": f"{text} {i}", "answer": "1"}) + "\n" for i in range(3))
    )
    as_train = load_tokenizer(tok_dir, model_type="qwen2")
    as_files = load_tokenizer(tok_dir)
    assert as_train(text)["input_ids"] != as_files(text)["input_ids"]  # the folder is ambiguous
    seen = {}
    encode = rl_loop._encode

    def spy(tokenizer, problems):
        ids = encode(tokenizer, problems)
        seen.setdefault("ids", ids)
        return ids

    monkeypatch.setattr(rl_loop, "_encode", spy)
    cfg = _config(
        tmp_path,
        "tok",
        model={"path": str(model_dir), "tokenizer": str(tok_dir)},
        data={"prompts_path": str(prompts)},
        train={"max_steps": 1, "save_every": 0},
    )
    rl(cfg, progress=False)
    problems = rl_loop.load_problems(str(prompts), "math")
    assert seen["ids"] == encode(as_train, problems) != encode(as_files, problems)


def test_an_fp64_rl_run_exports_fp32(tmp_path, tiny_tokenizer):
    cfg = _config(tmp_path, "fp64", model={"precision": "fp64"}, train={"max_steps": 1})
    result = rl(cfg, model=make_tiny_model(seed=1), tokenizer=tiny_tokenizer, progress=False)
    config = json.loads((result.hf_dir / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    assert next(iter(result.history))["updates"] == 1


def test_a_refused_rl_input_leaves_no_run_folder(tmp_path, capsys):
    cfg = tmp_path / "rl.yaml"
    cfg.write_text(
        f"run: {{name: gone, out_dir: {tmp_path / 'runs'}, device: cpu}}\n"
        f"model: {{path: {tmp_path / 'no-such-model'}}}\n"
        f"data: {{prompts_path: {_prompts(tmp_path / 'p.jsonl')}}}\n"
    )
    assert main(["rl", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "tokenizer" not in err
    assert not (tmp_path / "runs" / "gone").exists()


def test_keys_of_unreleased_layouts_are_unknown_keys_naming_the_file():
    """No release has been made, so older spellings get the one unknown-key error (file, key, known keys)."""
    from infir2.train.config import parse_config

    for parse, data, key in (
        (parse_rl_config, {"train": {"accept_config_changes": True}}, "train.accept_config_changes"),
        (parse_rl_config, {"train": {"max_nonfinite_in_row": 2}}, "train.max_nonfinite_in_row"),
        (parse_rl_config, {"rollout": {"scale": "fp32"}}, "rollout.scale"),
        (parse_config, {"load": {"accept_config_changes": True}}, "load.accept_config_changes"),
        (parse_config, {"train": {"max_nonfinite_in_row": 2}}, "train.max_nonfinite_in_row"),
    ):
        with pytest.raises(
            ValueError, match=rf"^old\.yaml: {re.escape(key)}: unknown key \(known keys: "
        ) as e:
            parse(data, "old.yaml")
        assert "\n" not in str(e.value)
    assert parse_rl_config({"run": {"accept_config_changes": True}}, "new.yaml").run.accept_config_changes
