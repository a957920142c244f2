"""The generated demo data: deterministic, correct (checked by Python's own arithmetic), train/test disjoint."""

from __future__ import annotations

import json
import re

import pytest

from infir2.data import SYSTEM_PROMPT, load_conversations, make_demo_data, render_conversation

EXPR = re.compile(r"^Compute (\d+(?: [+-] \d+)+)\.$")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("demo"), seed=0, n_train=400, n_test=100, n_cpt_worked=200)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_deterministic(demo, tmp_path):
    again = make_demo_data(tmp_path / "a", seed=0, n_train=400, n_test=100, n_cpt_worked=200)
    other = make_demo_data(tmp_path / "b", seed=1, n_train=400, n_test=100, n_cpt_worked=200)
    for name in ("cpt", "sft_train", "test"):
        assert demo[name].read_bytes() == again[name].read_bytes()
        assert demo[name].read_bytes() != other[name].read_bytes()


def test_answers_and_steps_are_correct(demo):
    for row in read_jsonl(demo["test"]):
        assert set(row) == {"problem", "answer", "id"}
        expr = EXPR.match(row["problem"]).group(1)
        assert row["answer"] == str(eval(expr))  # independent: Python evaluates left to right
    for conv in load_conversations(demo["sft_train"]):
        system, user, assistant = conv
        assert system == {"role": "system", "content": SYSTEM_PROMPT}
        expr = EXPR.match(user["content"]).group(1)
        think, answer = assistant["content"].split("\n</think>\n\n")
        assert think.startswith("<think>\n") and answer == f"The answer is \\boxed{{{eval(expr)}}}."
        for line in think.removeprefix("<think>\n").split("\n"):
            lhs, rhs = line.removesuffix(".").split(" = ")
            assert eval(lhs) == int(rhs) >= 0


def test_train_test_disjoint(demo):
    test = {EXPR.match(r["problem"]).group(1) for r in read_jsonl(demo["test"])}
    train = [EXPR.match(c[1]["content"]).group(1) for c in load_conversations(demo["sft_train"])]
    assert len(test) == 100 and len(train) == len(set(train)) == 400
    assert not test & set(train)
    cpt = [r["text"] for r in read_jsonl(demo["cpt"])]
    worked = {m.group(1) for t in cpt if (m := re.match(r"To work out (.+?), go", t))}
    assert len(worked) == 200 and not test & worked


def test_sizes_fit_the_demo(demo, tiny_tokenizer):
    assert demo["cpt"].stat().st_size < 300_000
    conv = load_conversations(demo["sft_train"])[0]
    ids, mask = render_conversation(tiny_tokenizer, conv)
    assert sum(mask) < len(ids) < 200  # short samples: tens of thousands of tokens per epoch
    assert "Licence" in demo["readme"].read_text()


def test_too_many_problems_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="distinct problems"):
        make_demo_data(tmp_path, n_train=10_000, n_test=10, max_operand=3, num_ops=(2, 2))
