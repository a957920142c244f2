"""The collapse guard (`rl/guard.py`): it warns on two recorded real RL runs from saturated starts,
and in a real tiny run the KL guard stops the run and hf/ holds the best held-out weights; FP8 rollouts
serve the export's base dtype (`rollout.base_dtype`), and TIS follows it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_tiny_model
from infir2.eval import GRADERS, Graded
from infir2.rl import parse_rl_config, rl
from infir2.rl.config import RLGuard, tis_mode
from infir2.rl.guard import CollapseGuard
from train_synthetic import one_thread

pytestmark = pytest.mark.transformers_api

_one_thread = pytest.fixture(autouse=True)(one_thread)

FIXTURE = Path(__file__).parent / "fixtures" / "rl_collapse"


def _replay(metrics: list[dict], guard_record: dict, cfg: RLGuard) -> list[tuple[int, str]]:
    guard = CollapseGuard(cfg)
    guard.start(guard_record["val_start"])
    return [(m["step"], v.why) for m in metrics if (v := guard.check(m)).why is not None]


def test_the_guard_warns_on_the_saturated_start_run():
    """The demo's saturated SFT start (99% greedy) through RL at lr 3e-4 on the harder split (docs/RL.md,
    "Collapse guard"; `benchmarks/rl_demo.py --split hard --val-every 5 --max-kl 0.25`): its recorded
    metrics.jsonl and guard.json. The held-out accuracy (the SFT val problems, two operations) falls while
    the rollout reward rises: replayed, the guard warns exactly where the run warned; at the defaults
    (no KL limit) its first warning is the first evaluation more than 5 points below the start."""
    metrics = [json.loads(x) for x in (FIXTURE / "metrics.jsonl").read_text().splitlines()]
    record = json.loads((FIXTURE / "guard.json").read_text())
    trips = _replay(metrics, record, RLGuard(max_kl=0.25))
    assert trips == [(t["step"], t["why"]) for t in record["trips"]]  # as the run itself warned
    assert any("KL to the start model" in why for _, why in trips)  # the KL ran away too
    evals = [(m["step"], m["val_accuracy"]) for m in metrics if "val_accuracy" in m]
    first_low = next(step for step, acc in evals if acc < record["val_start"] - 0.05)
    by_default = _replay(metrics, record, RLGuard())
    assert by_default and by_default[0][0] == first_low and "held-out accuracy" in by_default[0][1]
    rewards = [m["reward_mean"] for m in metrics]
    k = len(rewards) // 4
    assert sum(rewards[-k:]) / k > sum(rewards[:k]) / k  # the reward did not show it: it rose
    assert _replay(metrics, record, RLGuard(max_val_drop=None)) == []  # both off: silent


def test_the_guard_warns_on_issue_43s_saturated_start_whose_reward_stays_flat():
    """Issue 43's case on today's pipeline (fixtures/rl_collapse_two_op/README.md): a 2-epoch SFT start
    at 99% greedy, 40 steps at lr 3e-4 on the problems it already solves. Held-out accuracy halves while
    the mean reward stays flat and the KL stays under its limit; replayed at the defaults, the guard
    warns at the first evaluation and at every one after it, on the held-out accuracy alone."""
    folder = FIXTURE.parent / "rl_collapse_two_op"
    metrics = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    record = json.loads((folder / "guard.json").read_text())
    assert _replay(metrics, record, RLGuard(max_kl=0.25)) == [(t["step"], t["why"]) for t in record["trips"]]
    evals = [(m["step"], m["val_accuracy"]) for m in metrics if "val_accuracy" in m]
    assert record["val_start"] - evals[-1][1] > 0.4  # the collapse itself: 99% -> 51%
    by_default = _replay(metrics, record, RLGuard())
    assert [step for step, _ in by_default] == [step for step, _ in evals]  # every evaluation: 5, 10, ..., 40
    assert all("held-out accuracy" in why for _, why in by_default)
    rewards = [m["reward_mean"] for m in metrics]
    k = len(rewards) // 4
    assert abs(sum(rewards[-k:]) - sum(rewards[:k])) / k < 0.05  # what a reward plot shows: nothing
    assert max(m["kl_ref"] for m in metrics) < 0.25  # nor the KL alarm
    assert _replay(metrics, record, RLGuard(max_val_drop=0.6)) == []  # a 60-point limit: silent


@pytest.fixture
def scored(monkeypatch):
    """Training prompts: 1 for an odd number of characters (variance for an untrained model); the held-out
    problems (answer "always"): always right, so the start's held-out accuracy is the best there is."""

    def grade(problem, text):
        return Graded(None, True if problem.answer == "always" else len(text) % 2 == 1)

    monkeypatch.setitem(GRADERS, "scored", grade)


def _write(path: Path, answer: str | None, n: int) -> Path:
    rows = [{"problem": f"Compute {i} + {i + 1}.", "answer": answer or str(2 * i + 1)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_kl_guard_stops_a_run_and_exports_the_best_weights(tmp_path, tiny_tokenizer, scored):
    cfg = parse_rl_config(
        {
            "run": {"name": "g", "out_dir": str(tmp_path), "device": "cpu"},
            "model": {"precision": "fp32"},
            "optim": {"lr": 3e-2},
            "data": {
                "prompts_path": str(_write(tmp_path / "p.jsonl", None, 6)),
                "val_path": str(_write(tmp_path / "v.jsonl", "always", 3)),
            },
            "rollout": {"prompts_per_step": 2, "group_size": 4, "oversample_prompts": 3, "max_new_tokens": 8},
            "algo": {"reward": "scored", "updates_per_batch": 2, "micro_batch_size": 8},
            "train": {"max_steps": 8, "eval_every": 1},
            "guard": {"max_kl": 1e-3, "stop": True},
        },
        "test",
    )
    start = {k: v.clone() for k, v in make_tiny_model(seed=1).state_dict().items()}
    result = rl(cfg, model=make_tiny_model(seed=1), tokenizer=tiny_tokenizer, progress=False)
    kls = [m.get("kl_ref", 0.0) for m in result.history]
    assert kls[-1] > 1e-3 and all(k <= 1e-3 for k in kls[:-1])  # stopped at the first step over the limit
    assert len(result.history) < 8 and "KL to the start model" in result.history[-1]["guard"]
    assert not any("guard" in m for m in result.history[:-1])
    record = json.loads((tmp_path / "g" / "guard.json").read_text())
    assert record["stopped"] and record["val_start"] == 1.0 and record["hf_from_step"] == 0
    exported = load_file(tmp_path / "g" / "hf" / "model.safetensors")
    for name, tensor in start.items():  # hf/: the best held-out weights, here the start's
        assert torch.equal(exported[name], tensor), name
    assert result.checkpoint is not None and result.checkpoint.name == f"step_{len(kls):08d}"


def test_fp8_rollouts_serve_the_exports_base_dtype_and_tis_follows():
    base = {"run": {"name": "x"}, "data": {"prompts_path": "p.jsonl"}}
    bf16 = parse_rl_config(base, "test")
    assert bf16.rollout.base_dtype == "bf16" and tis_mode(bf16) == "truncate"
    fp32 = parse_rl_config({**base, "rollout": {"base_dtype": "fp32"}}, "test")
    assert tis_mode(fp32) == "off"  # fp8 rollouts + blockwise training, the trainer's values: identical
    with pytest.raises(ValueError, match=r"guard\.max_val_drop"):
        parse_rl_config({**base, "guard": {"max_val_drop": 5}}, "test")
    with pytest.raises(ValueError, match=r"rollout\.base_dtype"):
        parse_rl_config({**base, "rollout": {"base_dtype": "fp16"}}, "test")
