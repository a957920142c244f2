"""Evaluation: reasoning benchmarks (sample, extract the boxed answer, grade, avg@n / pass@k) and held-out loss.

See ``runner.evaluate`` for the in-process API, ``runner.run_evaluation`` with an engine of
``infir2.generation.ENGINES`` (the built-in one, an OpenAI-compatible server, or one registered by
name) for ``infir2 eval``, ``completions.CompletionLog`` for resuming, ``infir2.tasks.GRADERS`` for the graders,
and ``docs/EVAL_EXPORT.md`` for the file schemas.
"""

from ..data.chat import SYSTEM_PROMPT, THINK_PREFIX, render_prompt
from ..generation import SamplingConfig, ServerConfig, ServerError
from ..tasks import (
    GRADERS,
    TASKS,
    Graded,
    Problem,
    extract_boxed,
    extract_choice,
    final_part,
    grade_choice,
    grade_math,
    load_problems,
    math_equal,
    problems_from_dicts,
    register_grader,
    sample_path,
)
from .completions import Completion, CompletionLog
from .metrics import avg_at_n, pass_at_k
from .perplexity import LossResult, evaluate_loss
from .presets import PRESETS, Preset
from .runner import EvalResult, evaluate, run_evaluation

__all__ = [
    "GRADERS",
    "PRESETS",
    "SYSTEM_PROMPT",
    "TASKS",
    "THINK_PREFIX",
    "Completion",
    "CompletionLog",
    "EvalResult",
    "Graded",
    "LossResult",
    "Preset",
    "Problem",
    "SamplingConfig",
    "ServerConfig",
    "ServerError",
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
    "register_grader",
    "render_prompt",
    "run_evaluation",
    "sample_path",
]
