"""The GRPO / DAPO objective (infir2.rl.algorithm) against per-token loops in fp64 written from the formulas."""

from __future__ import annotations

import math

import pytest
import torch

from infir2.rl.algorithm import (
    FIELD_NAMES,
    group_advantages,
    mismatch_metrics,
    overlong_penalty,
    policy_loss,
    tis_weights,
)


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards, eps=1e-6)
    for g in range(3):
        r = rewards[g].tolist()
        mean = sum(r) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / 4)
        assert adv[g].tolist() == pytest.approx([(x - mean) / (std + 1e-6) for x in r], abs=1e-6)
    assert adv[2].abs().max() == 0  # a group that agrees carries no signal


def _reference_loss(logp, old, adv, mask, lo, hi, w, kl_coef, ref):
    total = 0.0
    for b in range(len(logp)):
        for t in range(len(logp[b])):
            if not mask[b][t]:
                continue
            ratio = math.exp(logp[b][t] - old[b][t])
            pg = max(-adv[b] * ratio, -adv[b] * min(max(ratio, 1 - lo), 1 + hi))
            d = ref[b][t] - logp[b][t]
            total += w[b][t] * pg + kl_coef * (math.exp(d) - d - 1)
    return total


def test_policy_loss_matches_the_formula_token_by_token():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.4  # ratios both sides of the clip
    ref = logp + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.1
    adv = torch.tensor([1.5, -0.7, 0.3], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    w = torch.rand(3, 5, generator=g, dtype=torch.float64) * 2
    total, stats = policy_loss(logp, old, adv, mask, 0.2, 0.28, w, kl_coef=0.05, ref_logp=ref)
    expected = _reference_loss(
        logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, w.tolist(), 0.05, ref.tolist()
    )
    assert float(total) == pytest.approx(expected, rel=1e-12)
    assert float(stats["tokens"]) == 9
    ratio = torch.exp(logp - old)
    high = ((ratio > 1.28) & (adv[:, None] > 0)).double() * mask
    assert float(stats["clip_high"]) == float(high.sum()) and float(stats["clip_high"]) > 0


def test_clip_higher_lets_positive_advantages_grow_further():
    """With A > 0 the gradient vanishes above 1 + clip_high (0.28), not at 1 + clip_low (0.2)."""
    old = torch.zeros(1, 1, dtype=torch.float64)
    for ratio, has_grad in ((1.25, True), (1.3, False)):
        logp = torch.full((1, 1), math.log(ratio), dtype=torch.float64, requires_grad=True)
        total, _ = policy_loss(logp, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 1), 0.2, 0.28)
        total.backward()
        assert (float(logp.grad) != 0) == has_grad


def test_token_level_aggregation_weighs_every_token_alike():
    """Summed over tokens (divided by the batch's token count later): a long response's tokens each get
    the same gradient as a short one's, unlike a per-sequence mean."""
    logp = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    total, _ = policy_loss(logp, logp.detach(), torch.ones(2, dtype=torch.float64), mask, 0.2, 0.28)
    (total / mask.sum()).backward()
    assert logp.grad[0, 0] == logp.grad[1, 0] == pytest.approx(-1 / 5)


def test_tis_weights_truncate_mask_off():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    roll = torch.log(torch.tensor([0.5, 0.1, 0.9]))  # ratios 1, 5, 0.555...
    assert tis_weights(old, roll, "truncate", 2.0).tolist() == pytest.approx([1.0, 2.0, 5 / 9])
    assert tis_weights(old, roll, "mask", 2.0).tolist() == [1.0, 0.0, 1.0]
    assert tis_weights(old, roll, "off", 2.0).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="TIS mode"):
        tis_weights(old, roll, "clip", 2.0)


def test_mismatch_metrics_from_the_definitions():
    d = [0.0, 0.1, -0.2, 1.0]  # train - rollout
    roll = torch.tensor([-1.0, -2.0, -0.5, -3.0, -9.0])
    train = roll + torch.tensor([*d, 5.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    m = mismatch_metrics(train, roll, mask, cap=2.0)
    assert m["mismatch/abs_dlogp_mean"] == pytest.approx(sum(map(abs, d)) / 4, rel=1e-6)
    assert m["mismatch/abs_dlogp_max"] == pytest.approx(1.0, rel=1e-6)
    assert m["mismatch/k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 4, rel=1e-5)
    assert m["mismatch/prob_error"] == pytest.approx(sum(math.exp(abs(x)) for x in d) / 4, rel=1e-6)
    assert m["mismatch/tis_clip_frac"] == 0.25  # exp(1) > 2
    w = [math.exp(x) for x in d]
    assert m["mismatch/tis_ess"] == pytest.approx(sum(w) ** 2 / (4 * sum(x * x for x in w)), rel=1e-6)
    same = mismatch_metrics(roll, roll, mask, 2.0)
    assert (
        same["mismatch/abs_dlogp_max"] == 0
        and same["mismatch/prob_error"] == 1
        and same["mismatch/tis_ess"] == 1
    )


def test_mismatch_under_the_fields_names_follows_each_stacks_formula():
    """slime, verl and NeMo-RL's names, each computed here as that stack writes it (masked token means of
    per-token terms; train = the trainer's log-probability, gen = the engine's), not read from infir2's."""
    torch.manual_seed(0)
    gen = -torch.rand(3, 7) * 4
    train = gen + torch.randn(3, 7) * 0.3
    mask = (torch.rand(3, 7) > 0.3).float()
    m = mismatch_metrics(train, gen, mask, cap=2.0)

    def masked_mean(x: torch.Tensor) -> float:
        return float((x.double() * mask).sum() / mask.sum())

    log_ratio = train.double() - gen.double()
    # slime (per-token loss): |old_log_probs - rollout_log_probs|
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(masked_mean((train - gen).abs()), rel=1e-6)
    # verl rollout_corr: log_ratio = old_log_prob - rollout_log_prob; exp(log_ratio) - log_ratio - 1
    assert m["rollout_corr/k3_kl"] == pytest.approx(masked_mean(log_ratio.exp() - log_ratio - 1), rel=1e-6)
    # NeMo-RL: calculate_kl(logprobs=gen, reference=train, k3) = exp(train - gen) - (train - gen) - 1
    assert m["gen_kl_error"] == pytest.approx(masked_mean(log_ratio.exp() - log_ratio - 1), rel=1e-6)
    # NeMo-RL: exp(|gen - prev| * mask), masked mean
    assert m["token_mult_prob_error"] == pytest.approx(
        masked_mean(torch.exp((gen - train).abs() * mask)), rel=1e-6
    )
    assert set(FIELD_NAMES) <= set(m) and all(m[name] == m[key] for name, key in FIELD_NAMES.items())


def test_overlong_penalty_is_dapos_linear_ramp():
    lengths = torch.tensor([10, 12, 14, 16])
    assert overlong_penalty(lengths, 16, 4, 1.0).tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
