"""The sequence-level correction under context parallelism: a sequence's geometric mean and product are of
all its tokens, though each rank scores only its shard of the row -- the weights, the geometric mask and
the metrics from rows split over two ranks equal those of the rows scored whole (to fp32 rounding of the
log-probabilities), on both ranks alike (``tests/rl_correction_context_worker.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rl_correction_context_worker import GEO_MEANS, RESPONSES
from train_synthetic import one_thread, torchrun

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

_one_thread = pytest.fixture(autouse=True)(one_thread)


def test_split_rows_are_corrected_as_whole_rows(tmp_path):
    torchrun(Path(__file__).parent / "rl_correction_context_worker.py", tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    # the split is real: each rank's shard scores part of the response columns, and three of the four
    # responses have tokens on both shards
    (s0, w0), (s1, _) = ranks[0]["columns"], ranks[1]["columns"]
    assert s0 < 0 < s1 == s0 + w0  # contiguous shards: rank 1 starts where rank 0 ends
    assert sum(0 < s1 < n for n in RESPONSES) == 3
    for rec in ranks:
        assert torch.allclose(rec["split"], rec["whole"], rtol=1e-5, atol=1e-5)
        for level in ("token", "sequence", "geometric"):
            split, whole = rec[f"{level}/split/weights"], rec[f"{level}/whole/weights"]
            assert torch.equal(split == 0, whole == 0), level  # the same sequences dropped
            assert torch.allclose(split, whole, rtol=1e-4), level
            ms, mw = rec[f"{level}/split/metrics"], rec[f"{level}/whole/metrics"]
            assert set(ms) == set(mw)
            for key in ms:
                assert ms[key] == pytest.approx(mw[key], rel=1e-4, abs=1e-6), (level, key)
        # the band [0.9, 1.1] drops the rows of geometric mean 0.8 and 1.3, on every token of them
        dropped = [bool((rec["geometric/split/weights"][i, :n] == 0).all()) for i, n in enumerate(RESPONSES)]
        assert dropped == [not 0.9 <= g <= 1.1 for g in GEO_MEANS] == [False, False, True, True]
        m = rec["geometric/split/metrics"]
        assert m["mismatch/geo_mask_frac"] == 0.5
        assert m["mismatch/geo_ratio_max"] == pytest.approx(1.3, rel=1e-4)
        assert m["mismatch/geo_ratio_min"] == pytest.approx(0.8, rel=1e-4)
        assert m["mismatch/geo_ratio_mean"] == pytest.approx(sum(GEO_MEANS) / 4, rel=1e-4)
        kept = rec["sequence/split/weights"][1, 0]  # the product of the kept row of mean 1.05, truncated
        assert float(kept) == pytest.approx(min(math.exp(RESPONSES[1] * math.log(1.05)), 1.5), rel=1e-4)
    for key in ranks[0]:  # every context rank holds the whole rows' numbers
        a, b = ranks[0][key], ranks[1][key]
        if key != "columns":
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, key
