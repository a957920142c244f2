"""A diverging run stops before it saves diverged weights: the loss-spike guard (the loss stays finite,
so the non-finite guard never fires) and the refusal of learning rates no AdamW run uses."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from conftest import make_tiny_model
from infir2.checkpoint import load_checkpoint
from infir2.train import train
from infir2.train.loop import NonFiniteError
from train_synthetic import SyntheticSource, one_thread, tiny_run_config

_one_thread = pytest.fixture(autouse=True)(one_thread)


@pytest.mark.parametrize("lr", [1e6, 1.5])
def test_learning_rates_above_one_are_refused(tmp_path, lr):
    with pytest.raises(ValueError, match=r"<test>: optim.lr: .* is above 1: no AdamW run uses"):
        tiny_run_config(tmp_path, optim={"lr": lr})


def test_a_diverging_run_stops_and_keeps_its_last_healthy_checkpoint(tmp_path):
    """lr=1 (allowed) with a constant schedule: the tiny model's loss climbs from ln(300) = 5.7 to 14, 26,
    ... (measured), finite all the way; today's loop trains on and checkpoints every step."""
    cfg = tiny_run_config(
        tmp_path,
        "diverge",
        optim={"lr": 1.0},
        schedule={"name": "constant"},
        train={"max_steps": 8, "save_every": 1, "keep_last": 8},
    )
    source = SyntheticSource(seed=1, global_batch_size=4, micro_batch_size=2)
    with pytest.raises(NonFiniteError, match=r"loss spike .* train.loss_spike_nats=3.0") as error:
        train(cfg, model=make_tiny_model(), train_source=source, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "diverge" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)  # never non-finite
    first = next(r["step"] for r in rows if r["spike"])
    assert [r["spike"] for r in rows] == [False] * (first - 1) + [True] * 3  # 3 in a row stop the run
    losses = [r["loss"] for r in rows]
    for step in range(2, first + 1):  # the rule, step by step: spike = above the running median + 3 nats
        assert (losses[step - 1] > statistics.median(losses[: step - 1]) + 3.0) == (step == first), step
    saved = sorted(p.name for p in (tmp_path / "diverge" / "checkpoints").glob("step_*"))
    assert saved == [f"step_{s:08d}" for s in range(1, first)]  # nothing written from the first spike on
    assert f"step_{first - 1:08d}" in str(error.value)


def test_the_guard_can_be_turned_off(tmp_path):
    cfg = tiny_run_config(
        tmp_path,
        "off",
        optim={"lr": 1.0},
        schedule={"name": "constant"},
        train={"max_steps": 5, "loss_spike_nats": None},
    )
    result = train(
        cfg,
        model=make_tiny_model(),
        train_source=SyntheticSource(seed=1, global_batch_size=4, micro_batch_size=2),
        progress=False,
    )
    assert result.step == 5 and not any(m["skipped"] for m in result.history)
    assert load_checkpoint(result.checkpoint)["train_state"]["step"] == 5
