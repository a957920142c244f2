"""Sequence-level rollout correction: one importance ratio per sequence, and geometric-mean masking.

Per response token t of row i, ``d_t = old_t - roll_t`` (the trainer's log-probability minus the rollout
engine's, as in ``algorithm``). ``algo.tis_level`` says what one importance ratio is taken over::

    token       rho_t = exp(d_t)               each token its own (algorithm.tis_weights)
    sequence    rho_i = exp(sum_t d_t)         the product of the row's token ratios: the sequence's ratio
    geometric   rho_i = exp(mean_t d_t)        their geometric mean (does not grow with the length)

and ``algo.tis`` truncates (``min(rho, cap)``) or masks (``[rho <= cap]``) it: at a sequence level every
token of the row gets its sequence's weight, so ``mask`` drops whole sequences (sequence-mask TIS).
``algo.geo_mask: b`` drops, on top of that, every sequence whose geometric mean ``g_i = exp(mean_t d_t)``
leaves ``[1 - b, 1 + b]`` (geometric rejection: verl's ``rollout_rs: geometric`` with thresholds
``1 - b`` and ``1 + b``). A dropped token or sequence weighs 0 in the policy-gradient term and still
counts in the mini-batch's token count, as ``tis: mask`` drops a token.

The metrics (``correction_sums`` per rank, summed over ranks, then ``correction_from_sums``); a unit is a
token at ``token`` level, else a sequence; log-ratios are clamped to ``[-20, 20]`` before an exponential
enters a mean (as verl does, so that one wild sequence gives a large number, not inf)::

    geo_ratio_mean / _max / _min   of g_i over the sequences
    geo_mask_frac                  share of sequences outside the band (algo.geo_mask set)
    geo_mask_token_frac            their tokens' share of all tokens
    is_ratio_mean                  token mean of rho before truncation (a sequence's on each of its tokens)
    is_ratio_max / _min            over the units
    is_ratio_frac_high             share of units whose rho exceeds algo.tis_cap
    is_ess                         (sum_t w_t)^2 / (N sum_t w_t^2), w = rho clamped to [1 / cap, cap]
    chi2_token                     mean_t exp(d_t)^2 - 1             (chi-square divergence, token level)
    chi2_seq                       mean_i exp(sum_t d_t)^2 - 1       (sequence level)

each under ``mismatch/`` and again under verl's ``rollout_corr/`` name where verl computes the same number
(``VERL_NAMES``: the ``rollout_rs_*`` names with ``algo.geo_mask``, the ``rollout_is_*`` names at the levels
verl has, token and sequence; verl's ESS adds 1e-8 to a denominator).
"""

from __future__ import annotations

import math

import torch

from .algorithm import tis_weights

__all__ = [
    "CORRECTION_SUMS",
    "TIS_LEVELS",
    "VERL_NAMES",
    "correction_from_sums",
    "correction_metrics",
    "correction_sums",
    "correction_weights",
    "geo_keep",
    "level_log_ratios",
]

#: ``algo.tis_level``: what one importance ratio is taken over (the module doc)
TIS_LEVELS = ("token", "sequence", "geometric")

#: log-ratios are clamped to +-this before an exponential enters a metric (verl's SAFETY_BOUND)
SAFETY = 20.0


def _row_sums(old: torch.Tensor, roll: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``[B, R]``: the float64 sum of ``d = old - roll`` over the masked tokens, and their count."""
    m = mask.double()
    return ((old.double() - roll.double()) * m).sum(-1), m.sum(-1)


def level_log_ratios(old: torch.Tensor, roll: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``[B, R]`` float64: each token's log importance ratio at ``level`` (a sequence's on all its tokens)."""
    if level == "token":
        return old.double() - roll.double()
    s, n = _row_sums(old, roll, mask)
    if level == "sequence":
        return s[:, None].expand(old.shape)
    if level == "geometric":
        return (s / n.clamp(min=1))[:, None].expand(old.shape)
    raise ValueError(f"TIS level must be one of {', '.join(TIS_LEVELS)}, got {level!r}")


def geo_keep(old: torch.Tensor, roll: torch.Tensor, mask: torch.Tensor, band: float) -> torch.Tensor:
    """``[B]`` bool: the rows whose geometric-mean ratio ``exp(mean_t d_t)`` lies in ``[1 - band, 1 + band]``
    (a row without tokens has ratio 1)."""
    s, n = _row_sums(old, roll, mask)
    return _in_band(s / n.clamp(min=1), band)


def _in_band(log_g: torch.Tensor, band: float) -> torch.Tensor:
    g = torch.exp(log_g)
    return (g >= 1 - band) & (g <= 1 + band)


def correction_weights(
    old: torch.Tensor,
    roll: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    cap: float,
    level: str = "token",
    geo_band: float | None = None,
) -> torch.Tensor:
    """``[B, R]`` weights (no grad, ``old``'s dtype): ``algo.tis`` ``mode`` at ``level``, zero on the rows
    ``algo.geo_mask`` (``geo_band``) drops; at token level without a band exactly ``tis_weights``."""
    if level == "token":
        w = tis_weights(old, roll, mode, cap)
    else:
        log_ratio = level_log_ratios(old.detach(), roll, mask, level)
        w = tis_weights(log_ratio, torch.zeros_like(log_ratio), mode, cap).to(old.dtype)
    if geo_band is not None:
        w = w * geo_keep(old.detach(), roll, mask, geo_band)[:, None].to(w.dtype)
    return w


#: the float64 sums behind the metrics (``correction_sums``), in this order; they add over ranks
CORRECTION_SUMS = (
    "tokens",
    "seqs",
    "geo_ratio",
    "geo_out",
    "geo_out_tokens",
    "units",
    "is_high",
    "is_ratio",
    "ess_w",
    "ess_w_sq",
    "rho_sq_token",
    "rho_sq_seq",
)


def _exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.clamp(-SAFETY, SAFETY))


def correction_sums(
    old: torch.Tensor, roll: torch.Tensor, mask: torch.Tensor, cap: float, level: str, geo_band: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sums ``CORRECTION_SUMS`` of the ``[B, R]`` rows' masked tokens and the maxima (max over ranks
    combines them) ``[log g max, -log g min, log rho max, -log rho min]`` (-inf without tokens)."""
    sel = mask.bool()
    rows = sel.any(-1)
    d = (old.double() - roll.double())[sel]
    s, n = (x[rows] for x in _row_sums(old, roll, mask))
    log_g = s / n
    out = ~_in_band(log_g, geo_band) if geo_band is not None else torch.zeros_like(log_g, dtype=torch.bool)
    if level == "token":
        log_rho, per = d, torch.ones_like(d)
    else:
        log_rho, per = (s if level == "sequence" else log_g), n
    w = _exp(log_rho).clamp(1 / cap, cap)
    sums = torch.stack(
        [
            n.sum(),
            torch.tensor(float(s.numel()), dtype=torch.float64),
            _exp(log_g).sum(),
            out.double().sum(),
            n[out].sum(),
            torch.tensor(float(log_rho.numel()), dtype=torch.float64),
            (torch.exp(log_rho) > cap).double().sum(),
            (_exp(log_rho) * per).sum(),
            (w * per).sum(),
            (w * w * per).sum(),
            _exp(d).square().sum(),
            _exp(s).square().sum(),
        ]
    )
    none = torch.tensor(-math.inf, dtype=torch.float64)

    def top(x: torch.Tensor) -> torch.Tensor:
        return x.max() if x.numel() else none

    return sums, torch.stack([top(log_g), top(-log_g), top(log_rho), top(-log_rho)])


def correction_from_sums(
    sums: torch.Tensor, maxima: torch.Tensor, level: str, geo_band: float | None
) -> dict[str, float]:
    """The metrics of the module doc from ``correction_sums`` (summed and maxed over ranks), under
    ``mismatch/`` and verl's names (``VERL_NAMES``); {} without tokens."""
    n, seqs, geo, out, out_tokens, units, high, ratio, ess_w, ess_w_sq, sq_tok, sq_seq = sums.tolist()
    if n == 0:
        return {}
    g_max, g_min, r_max, r_min = maxima.tolist()
    low = max(-r_min, -SAFETY) if level == "token" else -r_min  # verl clamps token weights, not a sequence's
    m = {
        "mismatch/geo_ratio_mean": geo / seqs,
        "mismatch/geo_ratio_max": math.exp(min(g_max, SAFETY)),
        "mismatch/geo_ratio_min": math.exp(-g_min),
        "mismatch/is_ratio_mean": ratio / n,
        "mismatch/is_ratio_max": math.exp(min(r_max, SAFETY)),
        "mismatch/is_ratio_min": math.exp(low),
        "mismatch/is_ratio_frac_high": high / units,
        "mismatch/is_ess": ess_w**2 / (n * ess_w_sq),
        "mismatch/chi2_token": sq_tok / n - 1,
        "mismatch/chi2_seq": sq_seq / seqs - 1,
    }
    if geo_band is not None:
        m["mismatch/geo_mask_frac"] = out / seqs
        m["mismatch/geo_mask_token_frac"] = out_tokens / n
    return m | {
        name: m[key] for name, key in VERL_NAMES.items() if key in m and _logged(name, level, geo_band)
    }


#: verl's ``rollout_corr/*`` names of these metrics: name -> the ``mismatch/*`` key it equals (when logged:
#: ``_logged``)
VERL_NAMES = {
    "rollout_corr/chi2_token": "mismatch/chi2_token",
    "rollout_corr/chi2_seq": "mismatch/chi2_seq",
    "rollout_corr/rollout_rs_seq_mean": "mismatch/geo_ratio_mean",
    "rollout_corr/rollout_rs_max": "mismatch/geo_ratio_max",
    "rollout_corr/rollout_rs_min": "mismatch/geo_ratio_min",
    "rollout_corr/rollout_rs_masked_fraction": "mismatch/geo_mask_token_frac",
    "rollout_corr/rollout_rs_seq_masked_fraction": "mismatch/geo_mask_frac",
    "rollout_corr/rollout_is_mean": "mismatch/is_ratio_mean",
    "rollout_corr/rollout_is_max": "mismatch/is_ratio_max",
    "rollout_corr/rollout_is_min": "mismatch/is_ratio_min",
    "rollout_corr/rollout_is_ratio_fraction_high": "mismatch/is_ratio_frac_high",
    "rollout_corr/rollout_is_eff_sample_size": "mismatch/is_ess",
}


def _logged(name: str, level: str, geo_band: float | None) -> bool:
    """Whether verl would log ``name`` with the same meaning: its rejection metrics when it rejects by the
    geometric mean (``algo.geo_mask``), its IS metrics at its levels (token, sequence)."""
    if name.startswith("rollout_corr/rollout_rs_"):
        return geo_band is not None
    if name.startswith("rollout_corr/rollout_is_"):
        return level in ("token", "sequence")
    return True


def correction_metrics(
    old: torch.Tensor,
    roll: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    level: str = "token",
    geo_band: float | None = None,
) -> dict[str, float]:
    """The metrics of the module doc for one set of ``[B, R]`` rows (one process)."""
    return correction_from_sums(*correction_sums(old, roll, mask, cap, level, geo_band), level, geo_band)
