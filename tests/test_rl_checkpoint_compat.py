"""RL checkpoints written by earlier versions of infir2 still resume where they left off.

``tests/fixtures/rl_checkpoint_v1/`` holds the step-2 checkpoint of a tiny `infir2 rl` run (a 1-layer
Qwen2 of width 64 in fp32, a KL reference, carried-over groups; no FP8, so that a CPU whose fp32 GEMMs
round otherwise cannot flip an FP8 code) written by the code before the run harness (``rl/loop.py``
with its own checkpoint layout: one data dict, one RNG dict), and ``expected.json`` with the metrics of
step 3 that code computed after resuming from it. The comparison has a tolerance (1e-5 relative)
because the fp32 GEMMs of a resumed step round differently on another CPU, and because the gradient
norm is now summed in float64 (it moved by 3e-7 relative here). The fixture is data from the past:
do not regenerate it with today's code (``python tests/test_rl_checkpoint_compat.py --write`` is how
it was written).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model, make_tokenizer
from infir2.eval import GRADERS, Graded
from infir2.rl import parse_rl_config, rl
from infir2.rl.algorithm import FIELD_NAMES

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "rl_checkpoint_v1"
SAVED_STEP, STEPS = 2, 3
#: metrics that depend on the machine's load, not on what is computed
TIMINGS = ("_time_s", "peak_mem_gib")


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
                "precision": "bf16",
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


def _plain(metrics: dict) -> dict:
    """Without timings, and without the field's names of the mismatch metrics (``FIELD_NAMES``: copies of
    ``mismatch/*`` keys the fixture holds, added after it was written)."""
    return {k: v for k, v in metrics.items() if not k.endswith(TIMINGS) and k not in FIELD_NAMES}


def test_an_old_rl_checkpoint_resumes_where_it_left_off(tmp_path, monkeypatch):
    monkeypatch.setitem(GRADERS, "parity", parity)
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    cfg = _config()
    step = f"step_{SAVED_STEP:08d}"
    shutil.copytree(FIXTURE / step, cfg.run_dir / "checkpoints" / step)
    result = _run(cfg)
    assert result.resumed_from is not None and result.resumed_from.name == step
    expected = json.loads((FIXTURE / "expected.json").read_text())["after_resume"]
    got = [_plain(m) for m in result.history]
    assert [m["step"] for m in got] == [m["step"] for m in expected] == [3]
    for a, b in zip(got, expected, strict=True):
        assert set(a) == set(b)
        exact = {k: v for k, v in b.items() if not isinstance(v, float)}
        assert {k: a[k] for k in exact} == exact
        assert [a[k] for k in b if k not in exact] == pytest.approx(
            [b[k] for k in b if k not in exact], rel=1e-5, abs=1e-7
        )


if __name__ == "__main__":  # how the fixture was written (by the code of its time; see the docstring)
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_rl_checkpoint_compat.py --write")
    torch.set_num_threads(1)
    GRADERS["parity"] = parity
    out = FIXTURE.parent / "_write"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    import os

    os.chdir(out)
    cfg = _config()
    history = [_plain(m) for m in _run(cfg).history]
    shutil.rmtree(FIXTURE, ignore_errors=True)
    FIXTURE.mkdir(parents=True)
    step = f"step_{SAVED_STEP:08d}"
    shutil.copytree(cfg.run_dir / "checkpoints" / step, FIXTURE / step)
    note = "written by infir2 before the run harness; metrics of steps 1-3 of one run"
    record = {"note": note, "metrics": history, "after_resume": history[SAVED_STEP:]}
    (FIXTURE / "expected.json").write_text(json.dumps(record, indent=1) + "\n")
    os.chdir(FIXTURE.parent)
    shutil.rmtree(out)
    print(history)
