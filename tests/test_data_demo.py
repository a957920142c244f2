"""The generated demo data: deterministic, correct (checked by Python's own arithmetic), train/test disjoint."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from infir2.data import SYSTEM_PROMPT, load_conversations, render_conversation
from infir2.tools.demo.data import make_demo_data, make_problems, task_facts, tokenizer_training_texts

SMALL = dict(n_train=400, n_test=100, n_cpt_worked=200, n_cpt_tables=50)
EXPR = re.compile(r"^Compute (\d+(?: [+-] \d+)+)\.$")
STEP = re.compile(r"^(\d+) ([+-]) (\d+) = (\d+)\.$")


def check_step(line: str) -> tuple[int, int]:
    """A worked line ``7 + 5 = 12.``: its format and arithmetic; returns (first operand, result)."""
    a, op, b, c = STEP.match(line).groups()
    assert eval(f"{int(a)} {op} {int(b)}") == int(c) >= 0  # independent: Python's arithmetic
    return int(a), int(c)


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
        value = int(expr.split()[0])
        for line in think.removeprefix("<think>\n").split("\n"):
            start, result = check_step(line)
            assert start == value, f"{line!r} does not start from the previous result {value}"
            value = result
        assert value == eval(expr)


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
        check_step(line)


def test_fact_tables_hold_every_fact_of_the_task_equally_often(demo):
    """50 tables x 16 lines = 800 over the space's 297 facts: each appears 2 or 3 times, the rare ones
    (a sum of ten or more, then another addition) as often as the first step's."""
    # the space, written out independently of the generator: a second step starts from any value
    # 0..18 (9 + 9 at most), adds 1..9 or subtracts at most the value; a first step is among these
    expected = {f"{v} + {c} = {v + c}." for v in range(19) for c in range(1, 10)}
    expected |= {f"{v} - {c} = {v - c}." for v in range(19) for c in range(1, min(v, 9) + 1)}
    assert sorted(expected) == task_facts(9, (2, 2)) and len(expected) == 297
    lines = [
        line
        for r in read_jsonl(demo["cpt"])
        if r["text"].startswith("Arithmetic facts:\n")
        for line in r["text"].split("\n")[1:]
    ]
    counts = Counter(lines)
    assert len(lines) == 50 * 16 and set(counts) == expected
    assert sorted(set(counts.values())) == [2, 3]


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
            check_step(line)


def test_sizes_fit_the_demo(demo, tiny_tokenizer, tmp_path):
    full = make_demo_data(tmp_path)  # the defaults: a few hundred KB at most
    assert full["cpt"].stat().st_size < 500_000 and full["sft_train"].stat().st_size < 500_000
    conv = load_conversations(demo["sft_train"])[0]
    ids, mask = render_conversation(tiny_tokenizer, conv)
    assert sum(mask) < len(ids) < 200  # short samples: tens of thousands of tokens per epoch
    assert "Licence" in demo["readme"].read_text()


def test_every_problem_is_equally_likely_in_a_split():
    """A split is a uniform sample of the space, not distinct draws of ``random_problem``, under which
    ``1 - 1 + c`` (a forced minus 1, then a forced plus) is ~10x likelier than a typical problem and
    the split drawn first took all nine of them. Over 200 seeds of 50 problems each of the 1,899
    problems is drawn with probability 50 / 1899: the nine together ~47 times."""
    hits = sum(
        r["problem"].startswith("Compute 1 - 1 + ") for seed in range(200) for r in make_problems(50, seed)
    )
    assert 25 <= hits <= 75, hits  # distinct draws of random_problem: 489


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


def test_harder_split_and_the_task_generator(demo, tmp_path):
    from infir2.tools.demo.data import harder, make_problems

    hard = read_jsonl(demo["test_hard"])
    assert len(hard) == 100 and harder((2, 2)) == (3, 3)
    for row in hard:
        expr = EXPR.match(row["problem"]).group(1)
        assert len(expr.split()) == 7 and row["answer"] == str(eval(expr))  # 3 operations
    test = [r["problem"] for r in read_jsonl(demo["test"])]
    fresh = make_problems(300, seed=5, exclude=test)
    assert make_problems(300, seed=5, exclude=test) == fresh  # deterministic
    assert len({r["problem"] for r in fresh}) == 300 and not {r["problem"] for r in fresh} & set(test)
    assert all(r["answer"] == str(eval(EXPR.match(r["problem"]).group(1))) for r in fresh)
    with pytest.raises(ValueError, match="results below 100"):
        make_problems(10, max_operand=30, num_ops=(3, 3))


def test_every_number_of_the_task_is_one_token(demo):
    """With ``whole_numbers``, a worked line has the same token count whatever its numbers' digits."""
    from infir2.data import train_bpe_tokenizer
    from infir2.tools.demo.data import NUMBERS, tokenizer_training_texts

    tok = train_bpe_tokenizer(tokenizer_training_texts(demo), vocab_size=400, whole_numbers=NUMBERS)
    lengths = {
        len(tok(line)["input_ids"]) for line in ("1 + 2 = 3.", "9 + 9 = 18.", "18 - 9 = 9.", "27 - 10 = 17.")
    }
    assert len(lengths) == 1
    assert tok.convert_ids_to_tokens(tok("= 18.")["input_ids"])[-2] == "18"
    text = load_conversations(demo["sft_train"])[0][2]["content"]
    assert tok.decode(tok(text)["input_ids"]) == text  # decodes back exactly


def test_demo_settings_give_make_demo_data_every_argument():
    """``DemoSettings.data_arguments`` names each of ``make_demo_data``'s settings (none left at its
    default by the demo) and nothing else: the one list of which settings are the data's."""
    import inspect

    from infir2.tools.demo.results import FULL, QUICK

    wanted = set(inspect.signature(make_demo_data).parameters) - {"out_dir"}
    for s in (FULL, QUICK):
        args = s.data_arguments()
        assert set(args) == wanted
        assert args["seed"] == s.data_seed and args["n_cpt_tables"] == s.n_cpt_tables
