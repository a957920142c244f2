"""Learning-rate schedules at their phase boundaries, against the closed-form values; AdamW groups."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from infir2.harness.optim import build_optimizer, make_schedule, param_groups
from infir2.train.config import OptimConfig, ScheduleConfig

LR, MIN_LR = 1e-4, 1e-5


def test_wsd_authors_schedule_at_boundaries():
    # 40k steps, 5k linear warmup, stable, final 5k steps cosine decay 1e-4 -> 1e-5 (docs/RECIPE.md section 2)
    s = make_schedule(ScheduleConfig("wsd", warmup_steps=5000, decay_steps=5000, min_lr=MIN_LR), LR, 40_000)
    assert s(0) == pytest.approx(LR / 5000)  # first warmup step
    assert s(2499) == pytest.approx(LR / 2)  # middle of warmup
    assert s(4999) == pytest.approx(LR)  # last warmup step reaches the peak
    assert s(5000) == LR and s(20_000) == LR and s(34_999) == LR  # stable
    assert s(35_000) == pytest.approx(LR)  # decay starts at the peak (cos 0 = 1)
    assert s(37_500) == pytest.approx((LR + MIN_LR) / 2)  # half-way: cos(pi/2) = 0
    assert s(36_250) == pytest.approx(MIN_LR + (LR - MIN_LR) * (1 + math.sqrt(0.5)) / 2)  # quarter: cos(pi/4)
    assert MIN_LR < s(39_999) < MIN_LR * 1.0001  # the last step is just above min_lr
    assert s(40_000) == pytest.approx(MIN_LR) and s(50_000) == pytest.approx(MIN_LR)


def test_wsd_linear_decay_and_fractions():
    cfg = ScheduleConfig(
        "wsd", warmup_fraction=0.1, decay_fraction=0.2, decay_style="linear", min_lr_ratio=0.1
    )
    s = make_schedule(cfg, LR, 100)
    assert (s.warmup_steps, s.decay_steps, s.min_lr) == (10, 20, pytest.approx(LR * 0.1))
    assert s(9) == pytest.approx(LR) and s(79) == LR and s(80) == pytest.approx(LR)
    assert s(85) == pytest.approx(LR - 0.25 * (LR - 0.1 * LR))  # a quarter into a linear decay
    assert s(100) == pytest.approx(0.1 * LR)


def test_cosine_with_warmup_fraction():
    # SFT: lr cosine to 0.1x with 5% warmup
    s = make_schedule(ScheduleConfig("cosine", warmup_fraction=0.05, min_lr_ratio=0.1), 2e-5, 1000)
    assert s.warmup_steps == 50
    assert s(0) == pytest.approx(2e-5 / 50) and s(49) == pytest.approx(2e-5)
    assert s(50) == pytest.approx(2e-5)  # cosine starts at the peak
    assert s(525) == pytest.approx((2e-5 + 2e-6) / 2)  # half-way through the 950 cosine steps
    assert s(1000) == pytest.approx(2e-6)
    lrs = [s(i) for i in range(50, 1001)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))  # monotone after warmup


def test_constant_and_bad_lengths():
    s = make_schedule(ScheduleConfig("constant", warmup_steps=4), LR, 10)
    assert [s(i) for i in (0, 3, 4, 9)] == pytest.approx([LR / 4, LR, LR, LR])
    with pytest.raises(ValueError, match="exceed"):
        make_schedule(ScheduleConfig("wsd", warmup_steps=6, decay_steps=6), LR, 10)


def test_weight_decay_groups(tiny_qwen2):
    decay, no_decay = param_groups(tiny_qwen2, 0.1)
    names = {id(p): n for n, p in tiny_qwen2.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert "model.embed_tokens.weight" in decayed and "lm_head.weight" in decayed
    assert all("norm" in n or n.endswith(".bias") for n in kept) and any(n.endswith(".bias") for n in kept)
    assert not any("norm" in n for n in decayed)
    assert len(decayed) + len(kept) == len(list(tiny_qwen2.parameters()))
    opt = build_optimizer(tiny_qwen2, OptimConfig(lr=1e-3, weight_decay=0.1))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and opt.param_groups[0]["foreach"]
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
