"""Tasks: the benchmark problems' JSONL schemas, the shipped samples, the answer extraction and the graders.

Below evaluation and RL, which both read problems and grade completions with them: ``infir2 eval`` scores
with ``GRADERS`` and RL rewards with the same grader (``reward``). ``registry.py`` holds the tasks and the
graders (a new task or grader is one entry), ``answers.py`` the extraction of the final ``\\boxed{}`` or
letter and the math-verify equivalence.
"""

from .answers import Graded, extract_boxed, extract_choice, final_part, grade_choice, grade_math, math_equal
from .registry import (
    GRADERS,
    TASKS,
    Grader,
    Problem,
    Task,
    load_problems,
    problems_from_dicts,
    register_grader,
    reward,
    sample_path,
)

__all__ = [
    "GRADERS",
    "TASKS",
    "Graded",
    "Grader",
    "Problem",
    "Task",
    "extract_boxed",
    "extract_choice",
    "final_part",
    "grade_choice",
    "grade_math",
    "load_problems",
    "math_equal",
    "problems_from_dicts",
    "register_grader",
    "reward",
    "sample_path",
]
