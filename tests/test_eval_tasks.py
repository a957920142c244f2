"""Benchmark JSONL loading: schemas, shipped samples, and errors that name file:line and the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infir2.eval.command import sample_path
from infir2.tasks import load_problems, problems_from_dicts


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("task", ["math", "multiple_choice"])
def test_shipped_samples_load(task: str) -> None:
    problems = load_problems(sample_path(task), task)
    assert len(problems) >= 5
    assert len({p.id for p in problems}) == len(problems)
    if task == "multiple_choice":
        assert all(p.answer in "ABCD"[: len(p.choices)] for p in problems)
        assert "(A) " in problems[0].user_message


def test_math_item_and_default_id(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            json.dumps({"problem": "1+1?", "answer": 2}),
            "",
            json.dumps({"problem": "x", "answer": "y", "id": 7}),
        ],
    )
    first, second = load_problems(path, "math")
    assert (first.id, first.answer, first.user_message) == ("bench-1", "2", "1+1?")
    assert second.id == "7"


@pytest.mark.parametrize(
    ("line", "task", "message"),
    [
        (
            '{"problem": "q", "anwser": "1"}',
            "math",
            r"bench.jsonl:2: missing key\(s\) \['answer'\]; unknown key\(s\) \['anwser'\]",
        ),
        ("{not json", "math", "bench.jsonl:2: invalid JSON"),
        ('["a list"]', "math", "bench.jsonl:2: expected a JSON object"),
        ('{"problem": "", "answer": "1"}', "math", "bench.jsonl:2: 'problem' must be a non-empty string"),
        (
            '{"question": "q", "choices": ["a", "b"], "answer": "C"}',
            "multiple_choice",
            r"bench.jsonl:2: 'answer' must be one of \['A', 'B'\]",
        ),
        (
            '{"question": "q", "choices": "ab", "answer": "A"}',
            "multiple_choice",
            "bench.jsonl:2: 'choices' must be a list",
        ),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, task: str, message: str) -> None:
    good = {
        "math": '{"problem": "q", "answer": "1"}',
        "multiple_choice": '{"question": "q", "choices": ["a", "b"], "answer": "A"}',
    }
    path = _write(tmp_path, [good[task], line])
    with pytest.raises(ValueError, match=message):
        load_problems(path, task)


def test_other_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="benchmark file not found"):
        load_problems(tmp_path / "missing.jsonl", "math")
    with pytest.raises(ValueError, match="unknown task 'code'"):
        load_problems(sample_path("math"), "code")
    with pytest.raises(ValueError, match="duplicate id 'a'"):
        problems_from_dicts([{"problem": "q", "answer": "1", "id": "a"}] * 2, "math")
    with pytest.raises(ValueError, match="no problems"):
        load_problems(_write(tmp_path, [""]), "math")
