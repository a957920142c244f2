"""Benchmark problems and their JSONL schemas.

One JSON object per line; blank lines are skipped. Two task types:

``math``::

    {"problem": "What is 7 * 6?", "answer": "42", "id": "demo-1"}       # id optional

``multiple_choice``::

    {"question": "Which is a prime?", "choices": ["4", "6", "7", "9"], "answer": "C", "id": "q1"}

``answer`` is the gold: a LaTeX / plain string for math (graded by equivalence), a letter
``A``.. for multiple choice (at most 26 choices). A missing ``id`` becomes ``<file stem>-<line>``.
Unknown keys are an error (a typo like ``"anwser"`` must not silently drop the gold).

``TASKS`` is the registry of tasks: a new task is one entry (its keys and the name of its grader); the
CLI's ``--task`` choices and the runner's grading come from it. ``GRADERS`` is the one registry of
graders -- ``(problem, completion) -> Graded`` -- that evaluation scores with and RL rewards with
(``reward``: 1.0 for a correct completion, else 0.0; ``algo.reward`` names a grader, the task's own by
default). A new grader is one ``register_grader(NAME, fn)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .._paths import jsonl_records
from .answers import Graded, grade_choice, grade_math

__all__ = [
    "GRADERS",
    "TASKS",
    "Grader",
    "Problem",
    "Task",
    "load_problems",
    "problems_from_dicts",
    "register_grader",
    "reward",
    "sample_path",
]


@dataclass(frozen=True)
class Problem:
    """One benchmark item: the user message to send, the gold answer, and the choice count (0 for math)."""

    id: str
    task: str
    question: str
    answer: str
    choices: tuple[str, ...] = field(default=())

    @property
    def user_message(self) -> str:
        """The user turn: the question, then the lettered choices for multiple choice."""
        if not self.choices:
            return self.question
        lines = [f"({chr(ord('A') + i)}) {c}" for i, c in enumerate(self.choices)]
        return self.question.rstrip() + "\n\n" + "\n".join(lines)


#: ``(problem, completion) -> Graded`` (the extracted answer, whether it is correct)
Grader = Callable[["Problem", str], Graded]


def _grade_math(problem: Problem, completion: str) -> Graded:
    return grade_math(completion, problem.answer)


def _grade_choice(problem: Problem, completion: str) -> Graded:
    return grade_choice(completion, problem.answer, n_choices=len(problem.choices))


#: grader name -> grader: what `infir2 eval` scores with and `infir2 rl` rewards with (``algo.reward``)
GRADERS: dict[str, Grader] = {"math": _grade_math, "multiple_choice": _grade_choice}


def register_grader(name: str, grader: Grader) -> None:
    """Add a grader (or replace one) under ``name``; ``algo.reward: NAME`` then rewards with it."""
    GRADERS[name] = grader


def reward(grader: str, problem: Problem, completion: str) -> float:
    """RL's reward: 1.0 when grader ``grader`` finds ``completion`` correct, else 0.0."""
    return 1.0 if GRADERS[grader](problem, completion).correct else 0.0


@dataclass(frozen=True)
class Task:
    """One benchmark type: the key of the question text, the keys of an item, and its grader's name."""

    text_key: str
    required: frozenset[str]
    grader: str  # a name in GRADERS
    optional: frozenset[str] = frozenset({"id"})

    def grade(self, problem: Problem, completion: str) -> Graded:
        return GRADERS[self.grader](problem, completion)


#: task name -> its schema and grader (the registry; ``--task`` choices come from here)
TASKS: dict[str, Task] = {
    "math": Task("problem", frozenset({"problem", "answer"}), "math"),
    "multiple_choice": Task("question", frozenset({"question", "choices", "answer"}), "multiple_choice"),
}


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: expected one of {', '.join(TASKS)}")


def _problem(obj: Any, task: str, where: str, default_id: str) -> Problem:
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    spec = TASKS[task]
    required, optional = spec.required, spec.optional
    missing = required - obj.keys()
    unknown = obj.keys() - required - optional
    if missing or unknown:
        problems = [f"missing key(s) {sorted(missing)}"] * bool(missing) + [
            f"unknown key(s) {sorted(unknown)}"
        ] * bool(unknown)
        raise ValueError(
            f"{where}: {'; '.join(problems)}; a {task} item has keys {sorted(required)} and optional 'id'"
        )
    text_key = spec.text_key
    text, answer = obj[text_key], obj["answer"]
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: {text_key!r} must be a non-empty string")
    multiple_choice = "choices" in required
    if isinstance(answer, (int, float)) and not isinstance(answer, bool) and not multiple_choice:
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"{where}: 'answer' must be a non-empty string, got {answer!r}")
    choices: tuple[str, ...] = ()
    if multiple_choice:
        raw = obj["choices"]
        if not isinstance(raw, list) or not 2 <= len(raw) <= 26 or not all(isinstance(c, str) for c in raw):
            raise ValueError(f"{where}: 'choices' must be a list of 2 to 26 strings")
        choices = tuple(raw)
        letters = [chr(ord("A") + i) for i in range(len(choices))]
        if answer.strip().upper() not in letters:
            raise ValueError(f"{where}: 'answer' must be one of {letters}, got {answer!r}")
        answer = answer.strip().upper()
    pid = obj.get("id", default_id)
    return Problem(id=str(pid), task=task, question=text, answer=answer.strip(), choices=choices)


def problems_from_dicts(
    items: Iterable[Mapping[str, Any]], task: str, source: str = "<memory>"
) -> list[Problem]:
    """Validate in-memory items (same schema as the JSONL lines) into ``Problem`` objects."""
    _check_task(task)
    out = [_problem(obj, task, f"{source}: item {i}", f"{i}") for i, obj in enumerate(items)]
    _check_unique_ids(out, source)
    return out


def load_problems(path: str | Path, task: str) -> list[Problem]:
    """Read a benchmark JSONL file; errors name ``file:line`` and the offending key."""
    _check_task(task)
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a folder, not a benchmark JSONL file")
    if not path.is_file():
        raise FileNotFoundError(f"benchmark file not found: {path}")
    out = [_problem(obj, task, f"{path}:{n}", f"{path.stem}-{n}") for n, obj in jsonl_records(path)]
    if not out:
        raise ValueError(f"{path}: no problems (the file is empty)")
    _check_unique_ids(out, str(path))
    return out


def _check_unique_ids(problems: list[Problem], source: str) -> None:
    seen: set[str] = set()
    for p in problems:
        if p.id in seen:
            raise ValueError(f"{source}: duplicate id {p.id!r}")
        seen.add(p.id)


def sample_path(task: str) -> Path:
    """The small sample benchmark shipped with infir2 for ``task`` (``samples/<task>.jsonl``)."""
    _check_task(task)
    return Path(str(resources.files("infir2.tasks") / "samples" / f"{task}.jsonl"))
