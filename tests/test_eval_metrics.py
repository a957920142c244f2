"""pass@k (unbiased estimator) against a brute-force count over all k-subsets; avg@n; default ks."""

from __future__ import annotations

import itertools
import math

import pytest

from infir2.eval.metrics import avg_at_n, default_ks, pass_at_k


def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_brute_force(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert math.isclose(
                pass_at_k(n, c, k), _brute_force_pass_at_k(n, c, k), rel_tol=1e-12, abs_tol=1e-12
            )


def test_pass_at_1_is_the_mean() -> None:
    assert pass_at_k(32, 8, 1) == pytest.approx(8 / 32)


def test_pass_at_k_rejects_bad_arguments() -> None:
    for n, c, k in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(n, c, k)


def test_avg_at_n_and_default_ks() -> None:
    assert avg_at_n([1, 0, 4], 4) == pytest.approx(5 / 12)
    assert default_ks(1) == [1]
    assert default_ks(8) == [1, 2, 4, 8]
    assert default_ks(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError):
        avg_at_n([], 4)
