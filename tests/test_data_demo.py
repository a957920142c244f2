"""The generated demo data: deterministic, correct (checked by Python's own arithmetic), train/test disjoint."""

from __future__ import annotations

import json
import re

import pytest

from infir2.data import SYSTEM_PROMPT, load_conversations, render_conversation
from infir2.tools.demo.data import make_demo_data, tokenizer_training_texts

SMALL = dict(n_train=400, n_test=100, n_cpt_worked=200, n_cpt_tables=50)
EXPR = re.compile(r"^Compute (\d+(?: [+-] \d+)+)\.$")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("demo"), seed=0, **SMALL)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_deterministic(demo, tmp_path):
    again = make_demo_data(tmp_path / "a", seed=0, **SMALL)
    other = make_demo_data(tmp_path / "b", seed=1, **SMALL)
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
    worked = [
        m.group(1) or m.group(2)
        for t in cpt
        if (m := re.search(r"To work out (.+?), go|Compute (.+?)\.(?:\n|<\|im_end\|>)", t))
    ]
    assert len(worked) == 200 and not test & set(worked)


def test_cpt_corpus(demo):
    cpt = [r["text"] for r in read_jsonl(demo["cpt"])]
    tables = [t for t in cpt if t.startswith("Arithmetic facts:\n")]
    assert len(tables) == 50 and len(cpt) == 250
    for line in "\n".join(t.split("\n", 1)[1] for t in tables).split("\n"):
        lhs, rhs = line.removesuffix(".").split(" = ")
        assert eval(lhs) == int(rhs) >= 0


def test_cpt_conversations_read_as_the_chat_template_renders_them(demo, tiny_tokenizer):
    """The rendered conversations in the CPT corpus are exactly what SFT and evaluation show the model."""
    cpt = [r["text"] for r in read_jsonl(demo["cpt"])]
    chats = [t for t in cpt if t.startswith("<|im_start|>system")]
    assert len(chats) >= 50
    for text in chats[:20]:
        user = re.search(r"<\|im_start\|>user\n(.+?)<\|im_end\|>", text).group(1)
        answer = text.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>")
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": user},
            {"role": "assistant", "content": answer},
        ]
        assert tiny_tokenizer.apply_chat_template(messages, tokenize=False).rstrip("\n") == text
        lines = answer.split("\n")[1:-3]  # between <think> and </think>
        for line in lines:
            lhs, rhs = line.removesuffix(".").split(" = ")
            assert eval(lhs) == int(rhs) >= 0


def test_sizes_fit_the_demo(demo, tiny_tokenizer, tmp_path):
    full = make_demo_data(tmp_path)  # the defaults: a few hundred KB at most
    assert full["cpt"].stat().st_size < 400_000 and full["sft_train"].stat().st_size < 400_000
    conv = load_conversations(demo["sft_train"])[0]
    ids, mask = render_conversation(tiny_tokenizer, conv)
    assert sum(mask) < len(ids) < 200  # short samples: tens of thousands of tokens per epoch
    assert "Licence" in demo["readme"].read_text()


def test_too_many_problems_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="distinct problems"):
        make_demo_data(tmp_path, n_train=10_000, n_test=10, max_operand=3, num_ops=(2, 2))


def test_tokenizer_texts_train_a_tokenizer(demo):
    from infir2.data import train_bpe_tokenizer

    texts = tokenizer_training_texts(demo)
    assert any(t.startswith("assistant\n<think>\n") for t in texts) and any(
        t.startswith("system\n") for t in texts
    )
    tok = train_bpe_tokenizer(texts, vocab_size=400)
    conv = load_conversations(demo["sft_train"])[0]
    ids, mask = render_conversation(tok, conv)
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == conv[2]["content"] + "<|im_end|>"
