"""Evaluation: reasoning benchmarks (sample, extract the boxed answer, grade, avg@n / pass@k) and held-out loss.

See ``runner.evaluate`` for the in-process API and ``docs/EVAL_EXPORT.md`` for the file schemas.
"""

from .answers import Graded, extract_boxed, extract_choice, final_part, grade_choice, grade_math, math_equal
from .generate import SYSTEM_PROMPT, THINK_PREFIX, SamplingConfig, render_prompt
from .metrics import avg_at_n, pass_at_k
from .perplexity import LossResult, evaluate_loss
from .runner import EvalResult, evaluate
from .tasks import TASKS, Problem, load_problems, problems_from_dicts, sample_path

__all__ = [
    "SYSTEM_PROMPT",
    "TASKS",
    "THINK_PREFIX",
    "EvalResult",
    "Graded",
    "LossResult",
    "Problem",
    "SamplingConfig",
    "avg_at_n",
    "evaluate",
    "evaluate_loss",
    "extract_boxed",
    "extract_choice",
    "final_part",
    "grade_choice",
    "grade_math",
    "load_problems",
    "math_equal",
    "pass_at_k",
    "problems_from_dicts",
    "render_prompt",
    "sample_path",
]
