"""`infir2 rl` under ``fp8.recipe: nvfp4``: two CPU processes (gloo, FSDP2) train as one, bit for bit.

NVFP4 rounds the gradient dY stochastically. Each micro-batch's draws come from a generator seeded by
the run's seed, the step, the mini-batch and the micro-batch's index in it (``harness.step.
rounding_noise``, as training's), so they do not depend on which rank runs the micro-batch; from torch's
global generator (as before), rank 1's first micro-batch drew what one process draws for micro-batch 0,
and the weights differed. The run is ``test_rl_distributed.py``'s (two mini-batches of 2 + 2 + 1
samples: rank 1 also runs a padding forward) with TIS off, so the loss does not take in the engine's
log-probabilities (which depend on the batching at float rounding); two steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from infir2.cli import main
from infir2.eval import GRADERS
from infir2.rl.algorithm import FIELD_NAMES
from rl_distributed_worker import parity
from test_rl_distributed import _config, _metrics
from train_synthetic import one_thread, torchrun

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

TESTS = Path(__file__).parent
_one_thread = pytest.fixture(autouse=True)(one_thread)


def _nvfp4_config(tmp_path: Path, tokenizer) -> Path:
    """``test_rl_distributed``'s config under nvfp4, TIS off, two steps, no held-out evaluation."""
    path = _config(tmp_path, tokenizer)
    raw = yaml.safe_load(path.read_text())
    raw["fp8"]["recipe"], raw["algo"]["tis"] = "nvfp4", "off"
    raw["train"] |= {"max_steps": 2, "eval_every": 0}
    path.write_text(yaml.safe_dump(raw))
    return path


def test_two_processes_take_the_rl_step_of_one_under_nvfp4(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setitem(GRADERS, "parity", parity)
    cfg = _nvfp4_config(tmp_path, tiny_tokenizer)
    torchrun(str(TESTS / "rl_distributed_worker.py"), "--no-engine-check", str(cfg), "--set", "run.name=two")
    assert main(["rl", str(cfg), "--no-progress", "--set", "run.name=one"]) == 0

    runs = tmp_path / "runs"
    two, one = _metrics(runs / "two"), _metrics(runs / "one")
    assert [m["step"] for m in two] == [m["step"] for m in one] == [1, 2]
    assert all(m["updates"] == 2 and not m.get("skipped") for m in one)  # both steps trained
    for a, b in zip(two, one, strict=True):
        # as test_rl_distributed: the engine's log-probabilities (the mismatch metrics) depend on its
        # batching, and the gradient norm sums squares over two shards, at float rounding
        rounded = [
            k
            for k in a
            if k.startswith(("mismatch/", "rollout_corr/")) or k in FIELD_NAMES or k == "grad_norm"
        ]
        assert {k: v for k, v in a.items() if k not in rounded} == {k: b[k] for k in a if k not in rounded}
    a = torch.load(runs / "two" / "checkpoints" / "step_00000002" / "state.pt", weights_only=True)
    b = torch.load(runs / "one" / "checkpoints" / "step_00000002" / "state.pt", weights_only=True)
    assert a["model"].keys() == b["model"].keys()
    for name, t in b["model"].items():
        assert torch.equal(a["model"][name], t), name
