"""Evaluation: reasoning benchmarks (sample, extract the boxed answer, grade, avg@n / pass@k) and held-out loss.

See ``runner.evaluate`` for the in-process API, ``runner.run_evaluation`` with an engine of
``infir2.generation.ENGINES`` (the built-in one, an OpenAI-compatible server, or one registered by
name) for ``infir2 eval``, ``completions.CompletionLog`` for resuming, ``infir2.tasks.GRADERS`` for the graders,
and ``docs/EVAL_EXPORT.md`` for the file schemas.
"""

from .. import tasks
from ..data.chat import SYSTEM_PROMPT, THINK_PREFIX, render_prompt
from ..generation import SamplingConfig, ServerConfig, ServerError
from ..tasks import *  # noqa: F403  (problems and graders, as infir2.eval has always offered them)
from .completions import Completion, CompletionLog
from .metrics import avg_at_n, pass_at_k
from .perplexity import LossResult, evaluate_loss
from .presets import PRESETS, Preset
from .runner import EvalResult, evaluate, run_evaluation

__all__ = [  # eval's own names, then the tasks'
    "PRESETS",
    "SYSTEM_PROMPT",
    "THINK_PREFIX",
    "Completion",
    "CompletionLog",
    "EvalResult",
    "LossResult",
    "Preset",
    "SamplingConfig",
    "ServerConfig",
    "ServerError",
    "avg_at_n",
    "evaluate",
    "evaluate_loss",
    "pass_at_k",
    "render_prompt",
    "run_evaluation",
    *tasks.__all__,
]
