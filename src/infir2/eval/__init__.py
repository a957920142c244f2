"""Evaluation: reasoning benchmarks (sample, extract the boxed answer, grade, avg@n / pass@k) and held-out loss.

See ``runner.evaluate`` for the in-process API, ``runner.run_evaluation`` with a ``LocalEngine`` or a
``ServerEngine`` (an OpenAI-compatible server, ``server.py``) for the engines behind ``infir2 eval``,
``completions.CompletionLog`` for resuming, and ``docs/EVAL_EXPORT.md`` for the file schemas.
"""

from .answers import Graded, extract_boxed, extract_choice, final_part, grade_choice, grade_math, math_equal
from .completions import CompletionLog
from .generate import SYSTEM_PROMPT, THINK_PREFIX, SamplingConfig, render_prompt
from .metrics import avg_at_n, pass_at_k
from .perplexity import LossResult, evaluate_loss
from .presets import PRESETS, Preset
from .runner import EvalResult, LocalEngine, ServerEngine, evaluate, run_evaluation
from .server import ServerConfig, ServerError
from .tasks import TASKS, Problem, load_problems, problems_from_dicts, sample_path

__all__ = [
    "PRESETS",
    "SYSTEM_PROMPT",
    "TASKS",
    "THINK_PREFIX",
    "CompletionLog",
    "EvalResult",
    "Graded",
    "LocalEngine",
    "LossResult",
    "Preset",
    "Problem",
    "SamplingConfig",
    "ServerConfig",
    "ServerEngine",
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
    "render_prompt",
    "run_evaluation",
    "sample_path",
]
