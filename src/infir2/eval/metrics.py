"""Scores over ``n`` samples per problem: avg@n and the unbiased pass@k estimator.

avg@n is the mean correctness over all samples (the authors report AIME avg@32, GPQA avg@8).
pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): with ``n`` samples of
which ``c`` are correct, the probability that at least one of ``k`` samples drawn without replacement
is correct::

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i)

The product form avoids huge binomials.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["avg_at_n", "default_ks", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct out of ``n`` samples (``1 <= k <= n``)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def avg_at_n(correct_counts: Sequence[int], n: int) -> float:
    """Mean fraction of correct samples over problems (each with ``n`` samples)."""
    if not correct_counts:
        raise ValueError("avg@n of zero problems")
    return sum(correct_counts) / (n * len(correct_counts))


def default_ks(n: int) -> list[int]:
    """The k reported for pass@k: powers of two up to ``n``, and ``n`` itself."""
    ks = [k for k in (2**i for i in range(n.bit_length())) if k <= n]
    return ks if ks[-1] == n else [*ks, n]
