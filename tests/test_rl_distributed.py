"""`infir2 rl` under torchrun: two CPU processes (gloo, FSDP2) train as one process does.

One torchrun launch runs two steps of a tiny run (checkpoint every step); one process then resumes it
for a third step (another world size). The reference is the same three steps in one process. What is
split and what is gathered (``rl.loop``): every rank generates and grades its share of each round's
prompts with per-prompt seeds, the groups are gathered, so the buffer and the batch are those of one
process; each rank backpropagates its micro-batches of every mini-batch. So the rollouts, rewards and
every count are equal, and, in this config, the gradients are too: each mini-batch has 3 micro-batches
(2, 2 and 1 samples), which two ranks reduce as ``(g0 + g1) + (g2 + 0)``, the order in which one process
accumulates them, and the loss is scaled by 2 (exact) before FSDP2 halves it (exact).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import make_tiny_model
from infir2.cli import main
from infir2.eval import GRADERS
from infir2.rl import parse_rl_config
from infir2.rl.algorithm import FIELD_NAMES
from infir2.rl.loop import my_micro_batches, plan_batches, share
from rl_distributed_worker import parity
from train_synthetic import one_thread, torchrun

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

TESTS = Path(__file__).parent
_one_thread = pytest.fixture(autouse=True)(one_thread)

#: the metrics that do not depend on how the work was split (timings and memory do)
UNSPLIT = ("_time_s", "peak_mem_gib")


def _problems(path: Path, n: int, offset: int = 0) -> str:
    with path.open("w") as f:
        for i in range(offset, offset + n):
            f.write(json.dumps({"problem": f"Compute {i} + {i + 1}.", "answer": str(2 * i + 1)}) + "\n")
    return str(path)


def _config(tmp_path: Path, tokenizer) -> Path:
    model_dir = tmp_path / "policy"
    make_tiny_model(seed=1).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    cfg = {
        "run": {"name": "rl", "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "model": {"path": str(model_dir), "precision": "fp32"},
        "fp8": {"recipe": "blockwise"},
        "optim": {"lr": 1e-3, "grad_clip": 0.0},
        "data": {
            "prompts_path": _problems(tmp_path / "prompts.jsonl", 6),
            "val_path": _problems(tmp_path / "val.jsonl", 3, offset=10),
        },
        "rollout": {
            "precision": "fp8",
            "prompts_per_step": 2,
            "group_size": 5,
            "oversample_prompts": 3,  # split 2 + 1 over the ranks
            "max_new_tokens": 8,
            "batch_size": 4,  # groups straddle generation batches
            "carry_over": True,
            # the trainer's tensors: the pair that quantizes identically, TIS off, so the loss does not
            # take in the engine's log-probabilities (which depend on the batching at float rounding)
            "base_dtype": "fp32",
        },
        "algo": {
            "reward": "parity",
            "overlong": "none",  # the untrained model rarely stops within 8 tokens: train on cut responses
            "updates_per_batch": 2,
            "micro_batch_size": 2,
            "kl_coef": 0.01,
        },
        "train": {"max_steps": 3, "save_every": 1, "eval_every": 1},
    }
    parse_rl_config(cfg, "test")  # valid as written
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _metrics(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.endswith(UNSPLIT)} for m in lines]


def test_two_processes_train_as_one(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setitem(GRADERS, "parity", parity)
    cfg = _config(tmp_path, tiny_tokenizer)
    torchrun(
        str(TESTS / "rl_distributed_worker.py"),
        str(cfg),
        "--set",
        "train.max_steps=2",
        "--set",
        "run.name=two",
    )
    runs = tmp_path / "runs"
    saved = torch.load(runs / "two" / "checkpoints" / "step_00000002" / "state.pt", weights_only=True)
    assert saved["train_state"]["world_size"] == 2 and saved["data"][0]["buffer"]  # groups carried over
    assert (runs / "two" / "hf" / "model.safetensors").is_file()  # exported by rank 0
    # the third step in one process, from the two processes' step-2 checkpoint
    assert main(["rl", str(cfg), "--no-progress", "--set", "run.name=two"]) == 0
    assert main(["rl", str(cfg), "--no-progress", "--set", "run.name=one"]) == 0

    two, one = _metrics(runs / "two"), _metrics(runs / "one")
    assert [m["step"] for m in two] == [m["step"] for m in one] == [1, 2, 3]
    for a, b in zip(two, one, strict=True):
        assert set(a) == set(b)
        # the engine's log-probabilities depend (at float rounding) on which sequences it batched together,
        # and the gradient norm sums its squares over two shards: equal to rounding, not bit for bit
        rounded = [
            k
            for k in a
            if k.startswith(("mismatch/", "rollout_corr/")) or k in FIELD_NAMES or k == "grad_norm"
        ]
        assert {k: v for k, v in a.items() if k not in rounded} == {k: b[k] for k in a if k not in rounded}
        assert [a[k] for k in rounded] == pytest.approx([b[k] for k in rounded], rel=1e-5, abs=1e-7)
    a = torch.load(runs / "two" / "checkpoints" / "step_00000003" / "state.pt", weights_only=True)
    b = torch.load(runs / "one" / "checkpoints" / "step_00000003" / "state.pt", weights_only=True)
    assert (
        a["data"][0]["prompts"] == b["data"][0]["prompts"]
        and a["data"][0]["buffer"] == b["data"][0]["buffer"]
    )
    assert torch.equal(a["data"][0]["sampler"], b["data"][0]["sampler"])
    for name, t in b["model"].items():
        assert torch.equal(a["model"][name], t), name


def test_shares_and_micro_batches_cover_everything_once():
    for k in range(8):
        for world in (1, 2, 3, 5):
            bounds = [share(k, r, world) for r in range(world)]
            assert [lo for lo, _ in bounds] == [0] + [hi for _, hi in bounds[:-1]] and bounds[-1][1] == k
            assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= 1
    assert share(3, 0, 2) == (0, 2) and share(3, 1, 2) == (2, 3)
    samples = list(range(10))
    plan = plan_batches(samples, 2, 2)  # two mini-batches of 5: micro-batches of 2, 2, 1
    assert plan == [[[0, 1], [2, 3], [4]], [[5, 6], [7, 8], [9]]]
    assert plan_batches(samples, 3, 4) == [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9]]]
    for mini in plan:
        for world in (1, 2, 3, 4):
            mine = [my_micro_batches(mini, r, world) for r in range(world)]
            assert len({len(m) for m in mine}) == 1  # the same number of forwards on every rank
            real = [micro for m in mine for micro in m if micro is not None]
            assert sorted(x for micro in real for x in micro) == [x for micro in mini for x in micro]
    assert my_micro_batches([[0, 1], [2, 3], [4]], 1, 2) == [[2, 3], None]
