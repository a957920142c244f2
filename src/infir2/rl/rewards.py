"""Rewards by name: ``(completion text, gold answer) -> float``; ``algo.reward`` picks one.

``math`` is the recipe's verifiable reward: 1 when the last ``\\boxed{}`` after ``</think>`` equals the
gold answer by mathematical equivalence (``infir2.eval.answers.grade_math``, math-verify; the grader
`infir2 eval --task math` scores with), else 0. A new reward is one entry of ``REWARDS``.
"""

from __future__ import annotations

from collections.abc import Callable

from ..eval.answers import grade_math

__all__ = ["REWARDS", "Reward", "math_reward"]

Reward = Callable[[str, str], float]


def math_reward(completion: str, gold: str) -> float:
    return 1.0 if grade_math(completion, gold).correct else 0.0


REWARDS: dict[str, Reward] = {"math": math_reward}
