"""Sequence-level rollout correction (``rl/correction.py``) against hand computations: which sequences the
geometric-mean mask drops, the weights at each ``algo.tis_level``, and every metric, under infir2's names
and verl's (each computed here from its definition, on Python floats, not read from infir2's)."""

from __future__ import annotations

import math

import pytest
import torch

from infir2.rl.algorithm import tis_weights
from infir2.rl.correction import VERL_NAMES, correction_metrics, correction_weights

#: d = train - rollout per token of three sequences (lengths 3, 2, 1); a padding column after each
D = [[0.0, 0.1, -0.1], [0.3, 0.3], [-0.05]]


def _rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[3, 4] float64 rollout / train log-probabilities with ``D`` between them, and the response mask."""
    roll = -torch.rand(3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    train, mask = roll.clone(), torch.zeros(3, 4)
    for i, row in enumerate(D):
        for t, d in enumerate(row):
            train[i, t] = roll[i, t] + d
            mask[i, t] = 1
    train[:, 3] = roll[:, 3] + 7.0  # padding: a wild value no metric and no weight may see
    return train, roll, mask


def test_geometric_mask_drops_the_sequences_outside_the_band():
    train, roll, mask = _rows()
    # geometric means exp(0) = 1, exp(0.3) = 1.35, exp(-0.05) = 0.951: only the second leaves [0.9, 1.1]
    w = correction_weights(train, roll, mask, "off", 2.0, "token", geo_band=0.1) * mask
    assert w.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
    w = correction_weights(train, roll, mask, "off", 2.0, "token", geo_band=0.4) * mask  # 1.35 is inside
    assert w.tolist() == mask.tolist()
    w = correction_weights(train, roll, mask, "off", 2.0, "token", geo_band=0.04) * mask  # 0.951 is out
    assert w.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]


def test_sequence_and_geometric_weights_truncate_and_mask():
    train, roll, mask = _rows()
    product = [math.exp(sum(row)) for row in D]  # 1, exp(0.6) = 1.82, exp(-0.05)
    geo = [math.exp(sum(row) / len(row)) for row in D]  # 1, exp(0.3) = 1.35, exp(-0.05)
    cases = [
        ("sequence", "truncate", 1.5, [min(p, 1.5) for p in product]),
        ("sequence", "mask", 1.5, [float(p <= 1.5) for p in product]),
        ("sequence", "truncate", 2.0, product),
        ("geometric", "truncate", 1.2, [min(g, 1.2) for g in geo]),
        ("geometric", "mask", 1.2, [float(g <= 1.2) for g in geo]),
        ("geometric", "off", 1.2, [1.0, 1.0, 1.0]),
    ]
    for level, mode, cap, per_seq in cases:
        w = correction_weights(train, roll, mask, mode, cap, level)
        for i, row in enumerate(D):  # one weight on every token of the sequence
            assert w[i, : len(row)].tolist() == pytest.approx([per_seq[i]] * len(row), rel=1e-12), (
                level,
                mode,
            )
    # with a band too: the weights of the rows it keeps, 0 on the row it drops
    w = correction_weights(train, roll, mask, "truncate", 1.5, "sequence", geo_band=0.1)
    assert w[:, 0].tolist() == pytest.approx([1.0, 0.0, product[2]], rel=1e-12)
    # token level is exactly algorithm.tis_weights
    for mode in ("truncate", "mask", "off"):
        assert torch.equal(
            correction_weights(train, roll, mask, mode, 1.2), tis_weights(train, roll, mode, 1.2)
        )
    with pytest.raises(ValueError, match="TIS level"):
        correction_weights(train, roll, mask, "truncate", 2.0, "segment")


def _ess(weights: list[float], cap: float) -> float:
    """verl's ESS: 1 / mean((w / mean w)^2) of the weights clamped to [1 / cap, cap] (its 1e-8 left out)."""
    w = [min(max(x, 1 / cap), cap) for x in weights]
    mean = sum(w) / len(w)
    return 1 / (sum((x / mean) ** 2 for x in w) / len(w))


def test_metrics_at_the_sequence_level_from_the_definitions():
    train, roll, mask = _rows()
    cap, band = 1.5, 0.1
    m = correction_metrics(train, roll, mask, cap, "sequence", band)
    geo = [math.exp(sum(row) / len(row)) for row in D]
    product = [math.exp(sum(row)) for row in D]
    per_token = [product[i] for i, row in enumerate(D) for _ in row]  # a sequence's weight on its tokens
    tokens = [d for row in D for d in row]
    expected = {
        "mismatch/geo_ratio_mean": sum(geo) / 3,
        "mismatch/geo_ratio_max": max(geo),
        "mismatch/geo_ratio_min": min(geo),
        "mismatch/geo_mask_frac": 1 / 3,  # the second sequence
        "mismatch/geo_mask_token_frac": 2 / 6,  # its two tokens of six
        "mismatch/is_ratio_mean": sum(per_token) / 6,
        "mismatch/is_ratio_max": max(product),
        "mismatch/is_ratio_min": min(product),
        "mismatch/is_ratio_frac_high": 1 / 3,  # exp(0.6) > 1.5
        "mismatch/is_ess": _ess(per_token, cap),
        "mismatch/chi2_token": sum(math.exp(d) ** 2 for d in tokens) / 6 - 1,
        "mismatch/chi2_seq": sum(p**2 for p in product) / 3 - 1,
    }
    assert set(expected) <= set(m)
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-9), key
    # verl's names: all twelve at the sequence level with a band, each the same number
    assert set(VERL_NAMES) <= set(m) and all(m[name] == m[key] for name, key in VERL_NAMES.items())


def test_metrics_at_the_token_and_geometric_levels():
    train, roll, mask = _rows()
    tokens = [d for row in D for d in row]
    m = correction_metrics(train, roll, mask, 1.2, "token")
    ratios = [math.exp(d) for d in tokens]
    assert m["mismatch/is_ratio_mean"] == pytest.approx(sum(ratios) / 6, rel=1e-9)
    assert m["mismatch/is_ratio_max"] == pytest.approx(math.exp(0.3), rel=1e-9)
    assert m["mismatch/is_ratio_min"] == pytest.approx(math.exp(-0.1), rel=1e-9)
    assert m["mismatch/is_ratio_frac_high"] == pytest.approx(2 / 6)  # the two exp(0.3) > 1.2
    assert m["mismatch/is_ess"] == pytest.approx(_ess(ratios, 1.2), rel=1e-9)
    assert (
        "mismatch/geo_mask_frac" not in m and "rollout_corr/rollout_rs_max" not in m
    )  # no band: no rejection
    assert m["rollout_corr/rollout_is_eff_sample_size"] == m["mismatch/is_ess"]
    g = correction_metrics(train, roll, mask, 1.2, "geometric")
    geo = [math.exp(sum(row) / len(row)) for row in D]
    assert g["mismatch/is_ratio_mean"] == pytest.approx(sum(geo[i] * len(row) for i, row in enumerate(D)) / 6)
    assert g["mismatch/is_ratio_frac_high"] == pytest.approx(1 / 3)  # exp(0.3) > 1.2
    assert not any(name.startswith("rollout_corr/rollout_is_") for name in g)  # verl has no geometric IS


def test_identical_log_probabilities_give_ratio_one_everywhere():
    _, roll, mask = _rows()
    m = correction_metrics(roll, roll, mask, 2.0, "sequence", 1e-9)
    assert m["mismatch/geo_ratio_max"] == m["mismatch/geo_ratio_min"] == 1
    assert m["mismatch/geo_mask_frac"] == 0 and m["mismatch/is_ess"] == 1
    assert m["mismatch/chi2_token"] == m["mismatch/chi2_seq"] == 0
    w = correction_weights(roll, roll, mask, "mask", 2.0, "geometric", 1e-9)
    assert (w == 1).all()
