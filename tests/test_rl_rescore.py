"""``rollout.rescore`` and the sequence-level correction inside ``infir2 rl`` on a tiny dense model: the
identical pairs' mismatch is exactly 0 and their TIS weights exactly 1 with rescoring, the geometric mask
drops the rows a hand computation on the step's own log-probabilities says, and the new keys' bad values
are one-line errors."""

from __future__ import annotations

import math

import pytest
import torch

from infir2.rl import loop as rl_loop
from infir2.rl import parse_rl_config
from test_rl_loop import _config, _run, parity_reward  # noqa: F401  (the fixture every run here uses)
from train_synthetic import one_thread

pytestmark = [
    pytest.mark.transformers_api,  # CI runs this file again under the oldest transformers
    pytest.mark.usefixtures("parity_reward"),
]

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _record_batches(monkeypatch) -> list:
    """Every step's RLBatch as the update sees it (after scoring), and the sampler's log-probabilities
    before rescoring replaced them (``sampled``)."""
    seen: list = []
    update, rescore = rl_loop.update, rl_loop.rescore

    def recording_rescore(run, batch, plan):
        batch.sampled = batch.rollout_logp.clone()
        return rescore(run, batch, plan)

    def recording_update(run, batch, *rest):
        seen.append(batch)
        return update(run, batch, *rest)

    monkeypatch.setattr(rl_loop, "rescore", recording_rescore)
    monkeypatch.setattr(rl_loop, "update", recording_update)
    return seen


#: the identical pairs (the engine computes what the trainer computes): FP8 rollouts of the trainer's
#: base tensors with blockwise training, and high-precision rollouts with high-precision training
IDENTICAL = {
    "fp8": ({"precision": "fp8", "base_dtype": "fp32"}, {"recipe": "blockwise"}),
    "high": ({"precision": "high"}, {"recipe": "bf16"}),
}


@pytest.mark.parametrize("pair", sorted(IDENTICAL))
def test_rescored_identical_pairs_have_zero_mismatch(tmp_path, tiny_tokenizer, monkeypatch, pair):
    rollout, fp8 = IDENTICAL[pair]
    seen = _record_batches(monkeypatch)
    cfg = _config(
        tmp_path,
        pair,
        rollout={**rollout, "rescore": True, "carry_over": False},
        fp8=fp8,
        algo={"tis": "truncate", "tis_level": "sequence"},
        train={"max_steps": 3, "save_every": 0},
    )
    result = _run(cfg, tiny_tokenizer)
    assert len(result.history) == 3 and all(m["updates"] == 2 for m in result.history)
    for m in result.history:
        assert m["mismatch/abs_dlogp_max"] == 0 and m["mismatch/k3_kl"] == 0
        assert m["mismatch/prob_error"] == 1 and m["mismatch/tis_ess"] == 1
        assert m["mismatch/is_ratio_max"] == m["mismatch/is_ratio_min"] == 1 and m["mismatch/chi2_seq"] == 0
        assert m["rescore_time_s"] > 0
    for batch in seen:
        real = torch.arange(batch.rollout_logp.shape[1])[None, :] < batch.response_len[:, None]
        assert torch.equal(batch.rollout_logp, batch.old_logp)  # bit for bit, padding (0) included
        assert torch.equal(batch.tis, real.float())  # every TIS weight exactly 1
        assert torch.equal(batch.sampled == 0, ~real)  # the sampler's were there before, replaced
    # without rescoring these runs' sampler differs in the last bits on some tokens: measured at this
    # commit (AMD EPYC, torch 2.13 CPU), 5 (fp8) and 46 (high) of 144 sampled log-probabilities changed


def test_geometric_mask_in_a_run_drops_the_rows_a_hand_computation_drops(
    tmp_path, tiny_tokenizer, monkeypatch
):
    """FP8 rollouts of bf16 base tensors against fp32 training: a real mismatch, and a band narrow enough
    that some sequences leave it (the first step's are checked row by row)."""
    seen = _record_batches(monkeypatch)
    band = 2e-3
    cfg = _config(
        tmp_path,
        "geo",
        rollout={"base_dtype": "bf16", "carry_over": False},
        algo={"tis": "truncate", "tis_level": "geometric", "geo_mask": band, "tis_cap": 1.001},
        train={"max_steps": 1, "save_every": 0},
    )
    (m,) = _run(cfg, tiny_tokenizer).history
    (batch,) = seen
    dropped, total_tokens, dropped_tokens = 0, 0, 0
    for i in range(len(batch)):
        n = int(batch.response_len[i])
        d = [float(batch.old_logp[i, t]) - float(batch.rollout_logp[i, t]) for t in range(n)]
        g = math.exp(sum(d) / n)
        weights = batch.tis[i, :n].tolist()
        total_tokens += n
        if not 1 - band <= g <= 1 + band:
            dropped, dropped_tokens = dropped + 1, dropped_tokens + n
            assert weights == [0.0] * n
        else:
            assert weights == pytest.approx([min(g, 1.001)] * n, rel=1e-6)
    assert 0 < dropped < len(batch), "the band should drop some rows and keep others"
    assert m["mismatch/geo_mask_frac"] == pytest.approx(dropped / len(batch))
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(dropped_tokens / total_tokens)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"algo": {"geo_mask": 1.5}}, r"algo.geo_mask: the band \[1 - b, 1 \+ b\] needs 0 < b < 1"),
        ({"algo": {"geo_mask": 0}}, r"algo.geo_mask: .*got 0"),
        ({"algo": {"tis": "off", "tis_level": "sequence"}}, r"algo.tis_level: sequence weighs nothing"),
        ({"algo": {"tis_level": "segment"}}, r"algo.tis_level"),
        ({"rollout": {"rescore": True, "engine": "server"}}, r"rollout.rescore: .*the builtin engine, not"),
        (
            {"rollout": {"rescore": True, "carry_over": True}},
            r"rollout.rescore: is refused with rollout.carry",
        ),
    ],
)
def test_bad_correction_keys_are_one_line_errors(sections, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_rl_config(sections, "rl.yaml")
    assert "rl.yaml" in str(e.value) and "\n" not in str(e.value)
