"""The GRPO / DAPO objective as plain tensor functions (no model, no I/O): what ``loop.py`` calls.

For a prompt with a group of ``n`` sampled responses and rewards ``r_1..r_n`` (``group_advantages``)::

    A_i = (r_i - mean(r)) / (std(r) + eps)                 one advantage per response, on all its tokens

Per response token t, with the trainer's log-probability ``logp`` (grad), the trainer's log-probability
before this rollout batch's updates ``old`` (no grad; the behaviour policy as the trainer computes it),
and the rollout engine's ``roll`` (``policy_loss``)::

    ratio = exp(logp - old)
    pg    = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))      PPO clip, clip-higher (DAPO)
    w     = min(exp(old - roll), cap)        TIS "truncate": corrects rollout/training mismatch (no grad)
          | [exp(old - roll) <= cap]         TIS "mask": drops the tokens whose ratio exceeds the cap
          | 1                                TIS off
    kl    = exp(ref - logp) - (ref - logp) - 1                   k3 estimate of KL(pi || ref), if kl_coef > 0
    loss  = sum_t mask_t * (w_t * pg_t + kl_coef * kl_t) / (response tokens of the whole mini-batch)

The last line is DAPO's token-level aggregation: every token of the mini-batch weighs the same, so
long responses are not down-weighted as in a per-sequence mean. ``mask`` is 0 on padding and, with
``algo.overlong: mask``, on every token of a response cut at ``max_new_tokens`` (DAPO's overlong
filtering); ``algo.overlong: penalty`` instead subtracts a linear length penalty from the reward
(``overlong_penalty``, DAPO's soft overlong punishment).

``mismatch_metrics`` measures how far the rollout engine's log-probabilities are from the trainer's
for the same tokens and weights (``d = old - roll``)::

    mean |d|, max |d|        log-probability error
    k3 = exp(d) - d - 1      mean: estimate of KL(pi_rollout || pi_train) (tokens were sampled from the rollout)
    prob_error = mean(exp(|d|))   NeMo-RL's token multiplicative probability error; healthy < 1.03-1.05
    tis_clip_frac            share of tokens whose ratio exp(d) exceeds the cap
    tis_ess                  (sum w)^2 / (N sum w^2) of the ratios: 1 = no mismatch, small = few tokens dominate

The same numbers are also logged under the names other RL stacks give them (``FIELD_NAMES``), so a run
compares with theirs without a conversion table: slime's ``train_rollout_logprob_abs_diff`` (mean |d|;
slime averages per-sample means unless ``--calculate-per-token-loss``: infir2's is the token mean),
verl's ``rollout_corr/k3_kl`` and NeMo-RL's ``gen_kl_error`` (both mean ``exp(d) - d - 1`` with
``d = train - rollout``: NeMo-RL's with its default k3 KL type), NeMo-RL's ``token_mult_prob_error``
(mean ``exp(|d|)``).
"""

from __future__ import annotations

import torch

__all__ = [
    "FIELD_NAMES",
    "MISMATCH_SUMS",
    "group_advantages",
    "mismatch_from_sums",
    "mismatch_metrics",
    "mismatch_sums",
    "overlong_penalty",
    "policy_loss",
    "tis_weights",
]


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``rewards [G, n]`` (G groups of n samples) -> advantages ``[G, n]``, normalised within each group."""
    r = rewards.double()
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    return ((r - mean) / (std + eps)).to(rewards.dtype)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to ``max - buffer`` tokens, then linearly down to ``-penalty``."""
    start = max_new_tokens - buffer
    over = (lengths.double() - start).clamp(min=0) / buffer
    return -penalty * over.clamp(max=1.0)


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mode: str, cap: float) -> torch.Tensor:
    """Per-token importance weights ``pi_train / pi_rollout`` for ``mode`` truncate | mask | off (no grad)."""
    ratio = torch.exp(old_logp.detach().double() - rollout_logp.double())
    if mode == "truncate":
        return ratio.clamp(max=cap).to(old_logp.dtype)
    if mode == "mask":
        return (ratio <= cap).to(old_logp.dtype)
    if mode == "off":
        return torch.ones_like(old_logp)
    raise ValueError(f"TIS mode must be truncate, mask or off, got {mode!r}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    weights: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed token loss of ``[B, T]`` log-probabilities (divide by the mini-batch's token count).

    ``advantages`` is ``[B]`` (one per response) or ``[B, T]``; ``mask`` is 1 on tokens that count.
    Returns the sum and per-token sums for the metrics: clipped tokens (low / high side), kl, tokens.
    """
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    m = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp.detach())
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    if weights is not None:
        pg = pg * weights.detach()
    loss = pg
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        d = ref_logp.detach() - logp
        kl = torch.exp(d) - d - 1
        if kl_coef:
            loss = loss + kl_coef * kl
    total = (loss * m).sum()
    with torch.no_grad():
        stats = {
            "clip_low": (((ratio < 1 - clip_low) & (adv < 0)).to(m.dtype) * m).sum(),
            "clip_high": (((ratio > 1 + clip_high) & (adv > 0)).to(m.dtype) * m).sum(),
            "kl": (kl.detach() * m).sum(),
            "tokens": m.sum(),
        }
    return total, stats


#: the sums behind the mismatch metrics (``mismatch_sums``), in this order; sums add over ranks
MISMATCH_SUMS = ("tokens", "abs_dlogp", "k3_kl", "prob_error", "tis_clipped", "ratio", "ratio_sq")


def mismatch_sums(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 sums ``MISMATCH_SUMS`` over the masked tokens, and the max ``|d|`` (0 when none):
    what ``mismatch_from_sums`` turns into the metrics; sums and maxima of several ranks combine exactly."""
    sel = mask.bool()
    d = (train_logp.double() - rollout_logp.double())[sel]
    ratio = torch.exp(d)
    sums = torch.stack(
        [
            torch.tensor(float(d.numel()), dtype=torch.float64),
            d.abs().sum(),
            (ratio - d - 1).sum(),
            torch.exp(d.abs()).sum(),
            (ratio > cap).double().sum(),
            ratio.sum(),
            (ratio**2).sum(),
        ]
    )
    return sums, d.abs().max() if d.numel() else torch.zeros((), dtype=torch.float64)


#: the field's names of infir2's mismatch metrics (the module doc): name -> the ``mismatch/*`` key it equals
FIELD_NAMES = {
    "train_rollout_logprob_abs_diff": "mismatch/abs_dlogp_mean",  # slime
    "rollout_corr/k3_kl": "mismatch/k3_kl",  # verl
    "gen_kl_error": "mismatch/k3_kl",  # NeMo-RL (k3)
    "token_mult_prob_error": "mismatch/prob_error",  # NeMo-RL
}


def mismatch_from_sums(sums: torch.Tensor, max_abs: torch.Tensor) -> dict[str, float]:
    """The metrics of the module doc from ``mismatch_sums`` (summed over ranks), and the same under the
    field's names (``FIELD_NAMES``); {} without tokens."""
    n, abs_d, k3, prob, clipped, ratio, ratio_sq = sums.tolist()
    if n == 0:
        return {}
    out = {
        "mismatch/abs_dlogp_mean": abs_d / n,
        "mismatch/abs_dlogp_max": float(max_abs),
        "mismatch/k3_kl": k3 / n,
        "mismatch/prob_error": prob / n,
        "mismatch/tis_clip_frac": clipped / n,
        "mismatch/tis_ess": ratio**2 / (n * ratio_sq),
    }
    return out | {name: out[key] for name, key in FIELD_NAMES.items()}


def mismatch_metrics(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> dict[str, float]:
    """Rollout-vs-trainer log-probability mismatch over the masked tokens (the formulas of the module doc)."""
    return mismatch_from_sums(*mismatch_sums(train_logp, rollout_logp, mask, cap))
