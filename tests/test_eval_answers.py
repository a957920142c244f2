"""Answer extraction and grading on a table of tricky cases (equivalent forms, look-alikes, boxes)."""

from __future__ import annotations

import pytest

from infir2.tasks import extract_boxed, extract_choice, final_part, grade_choice, grade_math

# (completion, gold, expected correct)
MATH_TABLE = [
    # equivalent forms
    (r"\boxed{\frac{1}{2}}", "0.5", True),
    (r"\boxed{0.5}", r"\frac{1}{2}", True),
    (r"\boxed{1/2}", r"\dfrac{1}{2}", True),
    (r"\boxed{\tfrac12}", "1/2", True),
    (r"\boxed{10^{3}}", "1000", True),
    (r"\boxed{1,000}", "1000", True),
    (r"\boxed{5\text{ cm}}", "5", True),
    (r"\boxed{6 \text{ apples}}", "6", True),
    (r"\boxed{90^\circ}", "90", True),
    (r"\boxed{\$18}", "18", True),
    (r"\boxed{x = 3}", "3", True),
    (r"\boxed{12.0}", "12", True),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", True),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\sqrt{3}/2", True),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", True),
    (r"\boxed{3, 4}", r"\{4, 3\}", True),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", True),
    (r"\boxed{\infty}", r"\infty", True),
    (r"\boxed{\text{yes}}", "yes", True),
    # wrong answers that look alike
    (r"\boxed{121}", "12", False),
    (r"\boxed{-3}", "3", False),
    (r"\boxed{0.333}", r"\frac{1}{3}", False),
    (r"\boxed{\frac{2}{1}}", r"\frac{1}{2}", False),
    (r"\boxed{(2,1)}", "(1,2)", False),
    (r"\boxed{10^{4}}", "1000", False),
    (r"\boxed{\sqrt{3}}", r"\sqrt{2}", False),
    (r"\boxed{3.14159}", r"\pi", False),
    (r"\boxed{x+1}", "x-1", False),
    # nested braces
    (r"so \boxed{\frac{\sqrt{2}}{2}}.", r"\frac{1}{\sqrt{2}}", True),
    (r"\boxed{\frac{{1}}{{4}}}", "0.25", True),
    (r"\boxed{2^{\frac{1}{2}}}", r"\sqrt{2}", True),
    # missing or broken box
    ("The answer is 42.", "42", False),
    (r"\boxed{42", "42", False),
    ("", "42", False),
    # several boxes: the last one counts
    (r"First \boxed{41}, then correcting: \boxed{42}", "42", True),
    (r"\boxed{42} no wait \boxed{41}", "42", False),
    # </think>: only the text after it counts
    (r"<think>\nmaybe \boxed{7}\n</think>\n\nThe answer is \boxed{42}.", "42", True),
    (r"<think>\nthe answer is \boxed{42}\n</think>\n\nI am not sure.", "42", False),
    (r"<think>\nstill thinking \boxed{42} and then cut off", "42", True),
    # \fbox and spacing
    (r"\fbox{42}", "42", True),
    (r"\boxed {42}", "42", True),
    (r"\boxed 7", "7", True),
]

# (completion, gold letter, expected correct)
CHOICE_TABLE = [
    ("The answer is (B).", "B", True),
    ("The answer is B", "B", True),
    ("the answer is **C**", "C", True),
    ("Answer: D", "D", True),
    ("ANSWER: A", "A", True),
    ("After analysis, **C** is right.", "C", True),
    (r"So the final answer is \boxed{B}.", "B", True),
    (r"\boxed{(D)}", "D", True),
    (r"\boxed{\text{A}}", "A", True),
    (r"\boxed{C. 42 kg}", "C", True),
    ("Option A is tempting, but the answer is (C)", "C", True),
    ("(A) is wrong, (B) is wrong. Answer: D", "D", True),
    ("I think it's D", "D", True),
    ("The answer is (B).", "C", False),
    (r"<think>\nAnswer: A\n</think>\n\nThe answer is (B).", "B", True),
    (r"<think>\nAnswer: B\n</think>\n\nThe answer is (A).", "B", False),
    ("The answer is a prime number.", "A", False),  # "a" is an article, not choice A
    ("I cannot decide.", "A", False),
    (r"\boxed{E}", "E", False),  # only four choices: E is not an option -> unparseable
]


@pytest.mark.parametrize(("completion", "gold", "expected"), MATH_TABLE)
def test_math_table(completion: str, gold: str, expected: bool) -> None:
    assert grade_math(completion, gold).correct is expected


@pytest.mark.parametrize(("completion", "gold", "expected"), CHOICE_TABLE)
def test_choice_table(completion: str, gold: str, expected: bool) -> None:
    assert grade_choice(completion, gold, n_choices=4).correct is expected


def test_table_size() -> None:
    assert len(MATH_TABLE) + len(CHOICE_TABLE) >= 40


def test_extract_boxed_keeps_nested_braces_and_takes_last() -> None:
    assert extract_boxed(r"\boxed{a} and \boxed{\frac{1}{\sqrt{2}}}") == r"\frac{1}{\sqrt{2}}"
    assert extract_boxed(r"\boxed{x} then \boxed{unclosed") == "x"
    assert extract_boxed("no box here") is None
    assert extract_boxed(r"\boxedfoo{1}") is None  # a different command, not \boxed


def test_unparseable_is_reported() -> None:
    graded = grade_math("I do not know", "42")
    assert not graded.parsed and not graded.correct
    assert grade_math(r"\boxed{41}", "42").parsed
    assert extract_choice("no letter here", 4) is None


def test_final_part() -> None:
    assert final_part("a</think>b</think>c") == "c"
    assert final_part("no think") == "no think"
