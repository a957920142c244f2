"""Answer checking for reasoning benchmarks: pull the final answer out of a completion and grade it.

The protocol (docs/RECIPE.md section 3) asks the model to "put your final answer within \\boxed{}", after
its thinking. So, for a completion:

1. ``final_part``: keep the text after the last ``</think>`` when there is one (the thinking may
   contain tentative boxes); otherwise the whole text.
2. ``extract_boxed``: the content of the *last* ``\\boxed{...}`` (or ``\\fbox{...}``), with nested
   braces, e.g. ``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``. No box -> ``None`` ("unparseable").
3. Math: ``math_equal(pred, gold)`` parses both with ``math-verify`` (LaTeX -> sympy) and compares by
   mathematical equivalence: ``1/2 = 0.5 = \\frac{1}{2}``, ``10^{3} = 1000``, ``x = 3`` vs ``3``, units
   and ``\\text{...}`` stripped, sets order-free; floats agree to 6 decimals. If math-verify cannot
   parse either side, the two strings are compared after light normalization.
4. Multiple choice: ``extract_choice`` returns the final letter, from a boxed letter first, then the
   last "answer is (B)" / "Answer: D" phrase, then a bold ``**C**``, then a lone letter ending the text.

The grading never raises on model output: anything that cannot be read counts as unparseable.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

__all__ = [
    "Graded",
    "extract_boxed",
    "extract_choice",
    "final_part",
    "grade_choice",
    "grade_math",
    "math_equal",
]

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_THINK_END = "</think>"


@dataclass(frozen=True)
class Graded:
    """The outcome of grading one completion: the extracted answer (None = unparseable) and the verdict."""

    extracted: str | None
    correct: bool

    @property
    def parsed(self) -> bool:
        return self.extracted is not None


def final_part(text: str) -> str:
    """The text after the last ``</think>``, or the whole text when the model wrote none."""
    _head, sep, tail = text.rpartition(_THINK_END)
    return tail if sep else text


def _box_starts(text: str) -> list[tuple[int, int]]:
    """(start of the command, index just after it) of every ``\\boxed`` / ``\\fbox`` in ``text``."""
    found = []
    for cmd in _BOX_COMMANDS:
        for m in re.finditer(re.escape(cmd) + r"(?![A-Za-z])", text):
            found.append((m.start(), m.end()))
    return sorted(found)


def _braced_content(text: str, i: int) -> str | None:
    """Content of the ``{...}`` group opening at or after ``i`` (spaces skipped), or None if unbalanced."""
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":  # "\boxed 5": the argument is the next token
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{" and text[j - 1] != "\\":
            depth += 1
        elif text[j] == "}" and text[j - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (nested braces kept)."""
    for _, after in reversed(_box_starts(text)):
        content = _braced_content(text, after)
        if content is not None and content.strip():
            return content.strip()
    return None


# ---------------------------------------------------------------------------------------------- math


def _timeout() -> int | None:
    # math-verify enforces its timeouts with SIGALRM, which only works in the main thread.
    return 5 if threading.current_thread() is threading.main_thread() else None


def _parse(expr: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    return parse(f"${expr}$", extraction_config=configs, parsing_timeout=_timeout())


def _normalize_text(s: str) -> str:
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right|,|;|!|\s)", "", s)
    return re.sub(r"\s+", "", s).strip("$.").lower()


def math_equal(pred: str, gold: str) -> bool:
    """True when two LaTeX / plain answers are mathematically equal (see the module docstring)."""
    from math_verify import verify

    gold_parsed, pred_parsed = _parse(gold), _parse(pred)
    if gold_parsed and pred_parsed:
        try:
            if verify(gold_parsed, pred_parsed, timeout_seconds=_timeout()):
                return True
        except Exception:  # math-verify/sympy edge cases: fall back to the string comparison below
            pass
    return _normalize_text(pred) == _normalize_text(gold) != ""


def grade_math(completion: str, gold: str) -> Graded:
    """Grade a math completion: last box after ``</think>`` vs the gold answer."""
    boxed = extract_boxed(final_part(completion))
    if boxed is None:
        return Graded(None, False)
    return Graded(boxed, math_equal(boxed, gold))


# ----------------------------------------------------------------------------------- multiple choice

_LETTER = r"\(?\**\s*([A-Z])\s*\**\)?(?![A-Za-z0-9])"
_ANSWER_PHRASE = re.compile(
    r"(?:answer|choice|option)(?:\s+is)?(?:\s+option)?\s*(?::|is)?\s*(?:\\text\{)?\**\s*" + _LETTER,
    re.IGNORECASE,
)
_BOLD = re.compile(r"\*\*\s*\(?([A-Z])\)?[.:]?\s*\*\*")
_TRAILING = re.compile(r"(?:^|[\s:(*])\(?([A-Z])\)?[\s.*)]*$")


def _letter_in_box(content: str) -> str | None:
    content = re.sub(r"\\text(?:bf)?\{([^{}]*)\}", r"\1", content)
    m = re.fullmatch(r"\s*\(?([A-Z])\)?(?:[.:)]\s.*|[.:)]?\s*)", content, re.DOTALL)
    return m.group(1) if m else None


def extract_choice(text: str, n_choices: int = 26) -> str | None:
    """The final answer letter (``"A"``...) in ``text``'s final part, or None; letters past ``n_choices`` are ignored."""
    valid = {chr(ord("A") + i) for i in range(n_choices)}
    part = final_part(text)
    boxed = extract_boxed(part)
    if boxed is not None:
        letter = _letter_in_box(boxed)
        return letter if letter in valid else None
    for pattern in (_ANSWER_PHRASE, _BOLD):
        # the phrase match ignores case ("The answer is"); the letter itself must be a valid capital
        hits = [m.group(1) for m in pattern.finditer(part) if m.group(1) in valid]
        if hits:
            return hits[-1]
    m = _TRAILING.search(part.strip())
    return m.group(1) if m and m.group(1) in valid else None


def grade_choice(completion: str, gold: str, n_choices: int = 26) -> Graded:
    """Grade a multiple-choice completion against the gold letter."""
    letter = extract_choice(completion, n_choices)
    return Graded(letter, letter is not None and letter == gold.strip().upper())
