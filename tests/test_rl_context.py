"""`infir2 rl` with ``parallel.context: 2``: every prompt + response split over two processes for the scoring
and the update (``rl/context.py``), compared with one process.

The run is ``test_rl_distributed.py``'s (FP8 blockwise training and rollouts, a KL reference, two
mini-batches of three micro-batches a step, three steps), on two CPU processes (gloo) that form one data
replica of two context ranks, with activation checkpointing (its backward gathers the keys and values
again). The rollouts are not split (each rank generates its share of the prompts, the groups are
gathered), so what a step samples and rewards is one process's as long as the weights are. The split
changes the order of fp32 sums and the grouping of the 128-token FP8 wgrad tiles (the rows are padded
to whole shards), so, as in ``test_context_parallel.py``, the yardstick is one process run again with
every weight moved by one ulp: measured, the context run's loss, gradient norm, KL, entropy and mismatch
metrics drift from one process by at most 1.7x as much as that control's (the loss, which sits near 0),
and each final weight by at most 0.8x; the scoring of the first step (the weights the run starts from)
agrees to fp32 rounding.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import cli_fails, make_tiny_model
from infir2.cli import main
from infir2.eval import GRADERS
from infir2.rl.algorithm import FIELD_NAMES
from rl_distributed_worker import parity
from test_rl_distributed import _config, _metrics
from train_synthetic import one_thread, torchrun

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

TESTS = Path(__file__).parent
_one_thread = pytest.fixture(autouse=True)(one_thread)

#: metrics that follow the weights' last bits, the mismatch under infir2's names and the field's
#: (FIELD_NAMES) included: compared against the one-ulp yardstick; the rest of a step's metrics --
#: rewards, accuracy, lengths, counts -- are equal
ROUNDED = (
    "loss",
    "grad_norm",
    "kl_ref",
    "entropy",
    "clip_low_frac",
    "clip_high_frac",
    "mismatch/",
    "rollout_corr/",
    *FIELD_NAMES,
)

#: the extremes of the sequences' geometric-mean ratios: each one sequence's value, whose drift the one
#: nudged run samples too thinly to bound it (measured: the largest 3.4x the control's, the smallest 0.5x);
#: test_rl_correction_context.py compares the sequence level under the split with one process directly
EXTREMES = ("mismatch/geo_ratio_max", "mismatch/geo_ratio_min")


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "step_00000003" / "state.pt", weights_only=True)["model"]


def _drift(runs: list[dict], reference: list[dict], key: str) -> float:
    return max(abs(a[key] - b[key]) for a, b in zip(runs, reference, strict=True))


def test_context_two_scores_and_trains_as_one_process(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setitem(GRADERS, "parity", parity)
    cfg = _config(tmp_path, tiny_tokenizer)
    worker = TESTS / "rl_distributed_worker.py"
    cp = [
        "--set",
        "parallel.context=2",
        "--set",
        "model.activation_checkpointing=true",
        "--set",
        "run.name=cp",
    ]
    torchrun(worker, "--no-engine-check", cfg, *cp)
    assert main(["rl", str(cfg), "--no-progress", "--set", "run.name=one"]) == 0
    nudged = make_tiny_model(seed=1)  # the policy _config saves, every weight one ulp up
    with torch.no_grad():
        for p in nudged.parameters():
            p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))
    nudged.save_pretrained(tmp_path / "nudged")
    tiny_tokenizer.save_pretrained(tmp_path / "nudged")
    path = f"model.path={tmp_path / 'nudged'}"
    assert main(["rl", str(cfg), "--no-progress", "--set", "run.name=ulp", "--set", path]) == 0

    runs = tmp_path / "runs"
    two, one, ulp = (_metrics(runs / name) for name in ("cp", "one", "ulp"))
    assert [m["step"] for m in two] == [m["step"] for m in one] == [1, 2, 3]
    rounded = [k for k in one[0] if k.startswith(ROUNDED)]
    for a, b in zip(two, one, strict=True):
        assert set(a) == set(b)
        assert {k: v for k, v in a.items() if k not in rounded} == {k: b[k] for k in a if k not in rounded}
    for key in (k for k in rounded if k not in EXTREMES):
        assert _drift(two, one, key) <= 3 * _drift(ulp, one, key) + 1e-7, key
    # step 1 scores the starting weights: the old log-probabilities are one process's to fp32 rounding
    assert two[0]["entropy"] == pytest.approx(one[0]["entropy"], rel=1e-6)
    assert two[0]["mismatch/abs_dlogp_mean"] < 1e-6 and one[0]["mismatch/abs_dlogp_mean"] < 1e-6
    assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-5)

    w_two, w_one, w_ulp = (_weights(runs / name) for name in ("cp", "one", "ulp"))
    for name, w in w_one.items():
        assert (w_two[name] - w).abs().max() <= 2 * (w_ulp[name] - w).abs().max(), name


def test_a_context_degree_that_does_not_divide_the_world_is_one_line(
    tmp_path, tiny_tokenizer, capsys, monkeypatch
):
    monkeypatch.setitem(GRADERS, "parity", parity)
    cfg = _config(tmp_path, tiny_tokenizer)
    for value, expected in (("2", "parallel.context: 2 does not divide the 1 processes"), ("0", "context")):
        cli_fails(capsys, ["rl", str(cfg), "--no-progress", "--set", f"parallel.context={value}"], expected)
    assert not (tmp_path / "runs").exists()


def test_the_shipped_32k_config_is_the_rl_config_with_longer_responses_over_four_ranks():
    """``qwen2.5-7b-rl-32k-cp``: ``qwen2.5-7b-rl`` with 32k-token responses split over 4 context ranks
    (and the rollout batch and micro-batch resized for them); every other setting the same."""
    from dataclasses import replace

    from infir2.rl.config import load_rl_config
    from infir2.train.config import resolve_config_path

    long, base = (load_rl_config(resolve_config_path(n)) for n in ("qwen2.5-7b-rl-32k-cp", "qwen2.5-7b-rl"))
    assert (long.parallel.context, long.rollout.max_new_tokens, long.model.activation_checkpointing) == (
        4,
        32768,
        True,
    )
    rollout = replace(
        long.rollout, max_new_tokens=base.rollout.max_new_tokens, batch_size=base.rollout.batch_size
    )
    algo = replace(long.algo, micro_batch_size=base.algo.micro_batch_size)
    same = replace(long, run=base.run, parallel=base.parallel, rollout=rollout, algo=algo)
    assert same == base
