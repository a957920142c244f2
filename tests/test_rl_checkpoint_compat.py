"""RL checkpoints of a layout no release has written are refused in one line; a record of the buffer alike.

``tests/fixtures/rl_checkpoint_v1/`` holds the step-2 checkpoint of a tiny `infir2 rl` run (a 1-layer
Qwen2 of width 64 in fp32, a KL reference, carried-over groups) written by the code before the run
harness (``rl/loop.py`` with its own checkpoint layout: one data dict, one RNG dict, the counters
``nonfinite_*``). No release has written that layout, so it is not read (CONTRIBUTING.md, "Layouts no
release has written"): the run stops before its first step with one line naming the folder. The
fixture is data from the past: do not regenerate it with today's code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model, make_tokenizer
from infir2.eval import GRADERS, Graded
from infir2.rl import parse_rl_config, rl
from infir2.rl.batch import Group, pad_rows

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "rl_checkpoint_v1"
SAVED_STEP, STEPS = 2, 3


def parity(problem, text: str) -> Graded:
    return Graded(None, len(text) % 2 == 1)


def _prompts(path: Path, n: int) -> str:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"problem": f"Compute {i} + {i + 1}.", "answer": str(2 * i + 1)}) + "\n")
    return str(path)


def _config():
    """The run's config, with paths relative to the working folder (the checkpoint records its config)."""
    return parse_rl_config(
        {
            "run": {"name": "rl", "out_dir": "runs", "device": "cpu"},
            "model": {"precision": "fp32"},
            "fp8": {"recipe": "bf16"},
            "optim": {"lr": 1e-3},
            "data": {"prompts_path": _prompts(Path("prompts.jsonl"), 6)},
            "rollout": {
                "precision": "high",
                "prompts_per_step": 2,
                "group_size": 3,
                "oversample_prompts": 3,
                "max_new_tokens": 6,
                "batch_size": 4,
                "carry_over": True,
            },
            "algo": {"reward": "parity", "overlong": "none", "micro_batch_size": 4, "kl_coef": 0.01},
            "train": {"max_steps": STEPS, "save_every": 1, "keep_last": 5},
        },
        "test",
    )


def _run(cfg):
    model = make_tiny_model(vocab_size=300, hidden=64, layers=1, seed=2)
    return rl(cfg, model=model, tokenizer=make_tokenizer(), progress=False)


def test_an_rl_checkpoint_from_before_the_harness_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(GRADERS, "parity", parity)
    monkeypatch.chdir(tmp_path)
    cfg = _config()
    step = cfg.run_dir / "checkpoints" / f"step_{SAVED_STEP:08d}"
    shutil.copytree(FIXTURE / step.name, step)
    with pytest.raises(ValueError) as e:
        _run(cfg)
    message = str(e.value)
    assert message.startswith(f"checkpoint {step}: data is not a list by saving rank; rng is not a list")
    assert (
        "train_state holds the counters nonfinite_in_row, nonfinite_total, samples_seen, step, updates"
        in message
    )
    assert "RLState has samples_seen, skipped_in_row, skipped_total, step, updates" in message
    assert "a layout this version does not read" in message and "\n" not in message
    assert [p.name for p in step.parent.iterdir()] == [step.name]  # kept, and no step trained


def test_a_buffer_record_without_its_lengths_is_refused():
    """``Group`` records always carry their lengths now; one without them is not re-derived."""
    group = Group(3, [2, 1], [True, False], [1.0, 0.0], [1.0, 0.0], [[5, 6], [7]], None)
    group.logprobs = pad_rows([torch.tensor([-0.5, -1.0]), torch.tensor([-2.0])])
    back = Group.from_record(group.to_record())
    assert (back.prompt, back.lengths, back.responses) == (3, [2, 1], [[5, 6], [7]])
    assert torch.equal(back.logprobs, group.logprobs)
    record = group.to_record()
    del record["lengths"]
    with pytest.raises(
        ValueError, match=r"buffer record has no lengths \(it holds correct, finished, logprobs"
    ):
        Group.from_record(record)
