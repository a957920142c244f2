"""`infir2 rl` end to end on a tiny model: run folder and metrics, dynamic sampling, bit-identical
resume after a crash, clear errors for bad configs and prompts files."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_model
from infir2.cli import main
from infir2.eval import GRADERS, Graded
from infir2.rl import loop as rl_loop
from infir2.rl import parse_rl_config, rl
from infir2.rl import update as rl_update
from train_synthetic import one_thread

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

_one_thread = pytest.fixture(autouse=True)(one_thread)


@pytest.fixture
def parity_reward(monkeypatch):
    """A reward with variance for an untrained model: 1 for an odd number of characters."""
    monkeypatch.setitem(GRADERS, "parity", lambda problem, text: Graded(None, len(text) % 2 == 1))


def _prompts(path, n=6):
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"problem": f"Compute {i} + {i + 1}.", "answer": str(2 * i + 1)}) + "\n")
    return path


def _config(tmp_path, name, **sections):
    data = {
        "run": {"name": name, "out_dir": str(tmp_path), "device": "cpu"},
        "model": {"precision": "fp32"},
        "fp8": {"recipe": "blockwise"},
        "optim": {"lr": 1e-3},
        "data": {"prompts_path": str(_prompts(tmp_path / "prompts.jsonl"))},
        "rollout": {
            "precision": "fp8",
            "prompts_per_step": 2,
            "group_size": 3,
            "oversample_prompts": 3,
            "max_new_tokens": 8,
            "batch_size": 9,
            "carry_over": True,
            "base_dtype": "fp32",  # the trainer's embeddings / norms / lm_head: the identical pair
        },
        "algo": {"reward": "parity", "updates_per_batch": 2, "micro_batch_size": 4},
        "train": {"max_steps": 3, "save_every": 1},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return parse_rl_config(data, "test")


def _run(cfg, tok):
    return rl(cfg, model=make_tiny_model(seed=1), tokenizer=tok, progress=False)


def test_rl_run_writes_the_train_conventions(tmp_path, tiny_tokenizer, parity_reward):
    result = _run(_config(tmp_path, "a"), tiny_tokenizer)
    run_dir = tmp_path / "a"
    assert (run_dir / "config.yaml").is_file() and (run_dir / "tensorboard").is_dir()
    assert (run_dir / "hf" / "config.json").is_file()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    m = lines[0]
    for key in (
        "reward_mean",
        "reward_std",
        "accuracy",
        "response_len_mean",
        "truncated_frac",
        "filtered_frac",
        "entropy",
        "clip_low_frac",
        "clip_high_frac",
        "grad_norm",
        "loss",
        "mismatch/abs_dlogp_mean",
        "mismatch/abs_dlogp_max",
        "mismatch/k3_kl",
        "mismatch/prob_error",
        "mismatch/tis_clip_frac",
        "mismatch/tis_ess",
    ):
        assert key in m and isinstance(m[key], (int, float)), key
    assert m["tis_mode"] == "off"  # fp8 rollouts + blockwise training quantize identically
    assert all(x["rollout_dtype"] == "float32" for x in lines)  # model.precision fp32: what it computed in
    assert m["mismatch/abs_dlogp_max"] < 1e-4  # ... so the trainer and the engine agree
    assert all(x["updates"] == 2 for x in lines)  # two optimizer steps per rollout batch
    assert result.checkpoint is not None and result.checkpoint.name == "step_00000003"


def test_dynamic_sampling_drops_groups_that_agree(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setitem(GRADERS, "constant", lambda problem, text: Graded(None, True))
    cfg = _config(
        tmp_path,
        "flat",
        algo={"reward": "constant"},
        rollout={"max_rounds": 2},
        train={"max_steps": 1, "save_every": 0},
    )
    m = _run(cfg, tiny_tokenizer).history[0]
    assert m["filtered_frac"] == 1.0 and m["groups_trained"] == 0 and m["rounds"] == 2 and m["updates"] == 0


def test_resume_after_a_crash_is_bit_identical(tmp_path, tiny_tokenizer, parity_reward, monkeypatch):
    whole = _run(_config(tmp_path, "whole"), tiny_tokenizer)
    calls = {"n": 0}
    update = rl_loop.update

    def crash_on_third(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("killed")
        return update(*args)

    monkeypatch.setattr(rl_loop, "update", crash_on_third)
    with pytest.raises(RuntimeError, match="killed"):
        _run(_config(tmp_path, "crashed"), tiny_tokenizer)
    monkeypatch.setattr(rl_loop, "update", update)
    resumed = _run(_config(tmp_path, "crashed"), tiny_tokenizer)
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "step_00000002"

    def lines(name):
        out = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [
            {k: v for k, v in m.items() if not k.endswith("_time_s") and k != "peak_mem_gib"} for m in out
        ]

    assert lines("crashed") == lines("whole")
    a = torch.load(whole.checkpoint / "state.pt", weights_only=True)
    b = torch.load(resumed.checkpoint / "state.pt", weights_only=True)
    saved = [
        torch.load(c / "state.pt", weights_only=True)
        for c in sorted((tmp_path / "whole" / "checkpoints").glob("step_*"))
    ]
    assert any(
        s["data"][0]["buffer"] for s in saved
    )  # a dynamic-sampling buffer was carried over a checkpoint
    assert (
        a["data"][0]["buffer"] == b["data"][0]["buffer"]
        and a["data"][0]["prompts"] == b["data"][0]["prompts"]
    )
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name


def test_bad_configs_and_prompts_are_clear_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  group_sise: 4\n")
    assert main(["rl", str(bad)]) == 2
    assert "rollout.group_sise: unknown key" in capsys.readouterr().err
    bad.write_text("rollout:\n  group_size: 1\n")
    assert main(["rl", str(bad)]) == 2
    assert "rollout.group_size" in capsys.readouterr().err
    bad.write_text("algo:\n  reward: nope\n")
    assert main(["rl", str(bad)]) == 2
    assert "algo.reward" in capsys.readouterr().err
    bad.write_text("rollout:\n  precision: bf16\n")  # the word of before one precision vocabulary
    assert main(["rl", str(bad)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and f"{bad}: rollout.precision: got 'bf16', expected high or fp8" in err[0], err
    assert "it is now rollout.precision: high" in err[0]
    bad.write_text("rollout:\n  group_size: 4\n")
    assert main(["rl", str(bad), "--set", "rollout.precision=bf16"]) == 2
    assert "with --set rollout.precision=bf16: rollout.precision: got 'bf16'" in capsys.readouterr().err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"problem": "1 + 1", "anwser": "2"}\n')
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(f"run: {{out_dir: {tmp_path}, device: cpu}}\ndata: {{prompts_path: {prompts}}}\n")
    assert main(["rl", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "p.jsonl:1" in err and "anwser" in err


def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path, tiny_tokenizer, parity_reward):
    _run(_config(tmp_path, "d", train={"max_steps": 2}), tiny_tokenizer)
    state = tmp_path / "d" / "checkpoints" / "step_00000002" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped: only the checksum can tell
    state.write_bytes(bytes(data))
    resumed = _run(_config(tmp_path, "d", train={"max_steps": 3}), tiny_tokenizer)
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "step_00000001"
    assert [m["step"] for m in resumed.history] == [2, 3]


def test_non_finite_updates_are_skipped_then_stop_the_run(
    tmp_path, tiny_tokenizer, parity_reward, monkeypatch
):
    real = rl_update.policy_loss

    def nan_loss(*args, **kwargs):
        total, stats = real(*args, **kwargs)
        return total * float("nan"), stats

    monkeypatch.setattr(rl_update, "policy_loss", nan_loss)
    cfg = _config(tmp_path, "nan", train={"max_steps": 4, "max_skipped_in_row": 2})
    with pytest.raises(ValueError, match="2 steps in a row had a non-finite"):
        _run(cfg, tiny_tokenizer)
    lines = [json.loads(x) for x in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped_updates"] for m in lines] == [2, 2]


@pytest.mark.slow
def test_rl_raises_the_reward_it_is_given(tmp_path, tiny_tokenizer, monkeypatch):
    """The objective points the right way: rewarded for short answers, an untrained model learns to stop."""
    monkeypatch.setitem(GRADERS, "short", lambda problem, text: Graded(None, len(text) < 12))
    cfg = _config(
        tmp_path,
        "short",
        optim={"lr": 1e-3},
        algo={"reward": "short", "micro_batch_size": 32},
        rollout={
            "prompts_per_step": 4,
            "group_size": 8,
            "oversample_prompts": 4,
            "max_new_tokens": 16,
            "batch_size": 32,
            "carry_over": False,
        },
        train={"max_steps": 10, "save_every": 0},
    )
    rewards = [m["reward_mean"] for m in _run(cfg, tiny_tokenizer).history]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards


def test_infir2_rl_from_a_model_folder(tmp_path, tiny_tokenizer, capsys):
    """The command line path: a model folder with its tokenizer, the `math` reward, resume on rerun,
    config changes refused unless accepted."""
    model_dir = tmp_path / "sft-hf"
    make_tiny_model(seed=2).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    cfg = tmp_path / "rl.yaml"
    cfg.write_text(
        f"run: {{name: cli, out_dir: {tmp_path}, device: cpu}}\nmodel: {{path: {model_dir}, precision: fp32}}\n"
        f"data: {{prompts_path: {_prompts(tmp_path / 'p.jsonl')}, val_path: {tmp_path / 'p.jsonl'}}}\n"
        "rollout: {prompts_per_step: 2, group_size: 2, oversample_prompts: 2, max_new_tokens: 4, max_rounds: 1}\n"
        "train: {max_steps: 1}\n"
    )
    assert main(["rl", str(cfg), "--no-progress"]) == 0
    line = json.loads((tmp_path / "cli" / "metrics.jsonl").read_text())
    # FP8 rollouts of the export's bf16 base dtype (the default) differ from the fp32 trainer: TIS on
    assert line["step"] == 1 and 0 <= line["val_accuracy"] <= 1 and line["tis_mode"] == "truncate"
    assert (tmp_path / "cli" / "hf" / "config.json").is_file()
    assert main(["rl", str(cfg), "--no-progress", "--set", "train.max_steps=2"]) == 0  # resumes at step 1
    steps = [json.loads(x)["step"] for x in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    capsys.readouterr()
    changed = ["--set", "train.max_steps=3", "--set", "algo.clip_high=0.3"]
    assert main(["rl", str(cfg), "--no-progress", *changed]) == 2  # a change of meaning is refused...
    assert "algo.clip_high: 0.28 -> 0.3" in capsys.readouterr().err
    assert (
        main(["rl", str(cfg), "--no-progress", *changed, "--accept-config-changes"]) == 0
    )  # ... unless accepted
    assert (tmp_path / "cli" / "config.2.yaml").is_file()  # the old config is kept


def test_sampled_held_out_accuracy_is_the_mean_reward_of_k_samples(tmp_path, tiny_tokenizer, parity_reward):
    """train.eval_samples: k samples per held-out problem at the rollout temperature, the reward averaged:
    against the exact expectation from the model's own next-token distribution (one new token, so the
    expectation is a sum over the vocabulary, in fp64), within 4 binomial standard errors."""
    from infir2.rl.loop import _encode
    from infir2.tasks import load_problems

    k, temperature = 400, 0.7
    val = _prompts(tmp_path / "val.jsonl", n=3)
    cfg = _config(
        tmp_path,
        "sampled",
        fp8={"recipe": "bf16"},
        optim={"lr": 1e-9},
        data={"val_path": str(val)},
        rollout={"precision": "high", "max_new_tokens": 1, "temperature": temperature, "batch_size": 64},
        train={"max_steps": 1, "save_every": 0, "eval_samples": k},
    )
    model = make_tiny_model(seed=1).double().eval()
    tok = tiny_tokenizer
    stops = set(rl_loop.stop_token_ids(tok))
    text_odd = torch.tensor(
        [
            0.0 if t in stops else float(len(tok.decode([t], skip_special_tokens=False)) % 2)
            for t in range(300)
        ],
        dtype=torch.float64,
    )
    expected, variance = [], 0.0
    with torch.no_grad():
        for ids in _encode(tok, load_problems(val, "math")):
            logits = model(torch.tensor([ids])).logits[0, -1, : len(text_odd)]
            p = float((torch.softmax(logits / temperature, -1) * text_odd).sum())
            expected.append(p)
            variance += p * (1 - p) / k
    exact = sum(expected) / len(expected)
    se = variance**0.5 / len(expected)
    assert 0.05 < exact < 0.95, "the check needs a reward with variance"
    rl(cfg, model=make_tiny_model(seed=1), tokenizer=tok, progress=False)
    measured = json.loads((tmp_path / "sampled" / "guard.json").read_text())["val_start"]
    assert abs(measured - exact) < 4 * se, (measured, exact, se)
    assert measured * 3 * k == pytest.approx(round(measured * 3 * k))  # a count over all 3 x k samples


def test_eval_samples_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match=r"train\.eval_samples"):
        _config(tmp_path, "bad", train={"eval_samples": 0})


def test_resume_with_another_held_out_measure_is_refused(tmp_path, tiny_tokenizer, parity_reward):
    """guard.json's start was measured one way: a rerun that measures held-out accuracy another way is
    refused, naming the key (greedy -> avg@k here)."""
    from infir2.harness.config_changes import ConfigChangedError

    val = {"val_path": str(_prompts(tmp_path / "val.jsonl", n=2))}
    _run(_config(tmp_path, "r", data=val, train={"max_steps": 1}), tiny_tokenizer)
    with pytest.raises(ConfigChangedError, match=r"train\.eval_samples: None -> 4"):
        _run(_config(tmp_path, "r", data=val, train={"max_steps": 2, "eval_samples": 4}), tiny_tokenizer)
