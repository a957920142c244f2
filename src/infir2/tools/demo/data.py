"""The demo's data: generated here, deterministically, from a seed (no download).

Licence: everything this module writes is synthetic -- produced by the code below from a random seed,
not derived from any dataset or text by anyone else -- so it carries no third-party rights; it is
distributed under the project's licence (Apache-2.0), like the code that makes it.

The task: multi-step integer arithmetic with worked steps, in the reasoning format of the eval protocol
(docs/RECIPE.md section 3). A problem and its SFT answer::

    Compute 7 + 5 - 3.
    <think>
    7 + 5 = 12.
    12 - 3 = 9.
    </think>

    The answer is \\boxed{9}.

The expression is evaluated left to right, one operation per line, each line starting from the
previous result; subtractions are drawn so that no intermediate result is negative. Difficulty is set
by ``max_operand`` (operands are 1..max_operand) and ``num_ops`` (operations per problem). The default
(2 operations, operands up to 9) has about 1,900 distinct problems and answers 0..27. Smaller settings
learn faster but have few problems (``max_operand=4``: 174) and a higher chance level: report the
majority-answer baseline of the test file next to the accuracy.

A from-scratch model needs two skills: the single-step facts (``8 + 5 = 13.``) and copying the
operands from the question into the steps. Facts alone (tables, plain worked lines) taught a tiny
model the facts but not the copy: its answers ignored the question. Half of the worked examples are
therefore the rendered conversation itself (ChatML, system prompt included), so the copy is learned
at the distance the model sees in SFT and evaluation; and the demo tokenizer makes every number below
``NUMBERS`` one token, so that distance is the same in every problem (with digits split, a two-digit
intermediate result shifts everything after it). Where the demo's accuracy stands per seed:
BENCHMARKS.md, "The reasoning task, seed by seed".

The task generator for other stages (an RL stage, a benchmark): ``make_problems(n, seed, ...)``
returns records of the math schema, optionally excluding given problems (``make_conversations``: the
same problems as SFT conversations); ``harder(num_ops)`` is the harder split's operation count (one
more than trained on), which a fine-tuned model leaves headroom on (``test_hard.jsonl``).

Files written by ``make_demo_data(out_dir)``:

* ``cpt.jsonl`` -- the continual pre-training corpus (``{"text": ...}`` per line): tables of
  single-step facts in the answers' line format (``12 - 3 = 9.``), worked multi-step examples in the
  same format and as rendered conversations, and some worked examples in prose. CPT is where a
  from-scratch model learns the facts and the copy; SFT then settles the answer format.
* ``sft_train.jsonl`` -- SFT conversations (``{"messages": [system, user, assistant]}``), with the eval
  system prompt.
* ``test.jsonl`` -- held-out problems in the math benchmark schema ``{"problem", "answer", "id"}``.
  No test expression appears in the SFT data or in the worked examples of the CPT corpus.
* ``test_hard.jsonl`` -- the harder split, same schema: problems one operation longer.
* ``README.md`` -- what the files are and their licence.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...data.chat import SYSTEM_PROMPT

__all__ = [
    "NUMBERS",
    "Problem",
    "harder",
    "make_conversations",
    "make_demo_data",
    "make_problems",
    "random_problem",
    "solution_text",
    "task_facts",
    "tokenizer_training_texts",
]


#: A problem: the first operand, then (operator, operand) pairs, evaluated left to right.
Problem = tuple[int, tuple[tuple[str, int], ...]]

_WORDS = {"+": "plus", "-": "minus"}
#: Every number of the task is below this, so the demo tokenizer makes each a token of its own
#: (``train_bpe_tokenizer(whole_numbers=NUMBERS)``): each line of an answer then has the same length in
#: tokens, and each number the model copies (an operand from the question, the previous result) sits
#: at the same distance in every problem.
NUMBERS = 100
_TABLE_LINES = 16  # facts in one fact-table document
_MAX_MISSES = 20_000  # draws in a row that find no new problem: the space is (nearly) exhausted
_LISTED_SPACE = 200_000  # a space at most this large (its upper bound) is listed and sampled uniformly


def random_problem(rng: random.Random, max_operand: int, num_ops: tuple[int, int]) -> Problem:
    """A problem with ``num_ops[0]..num_ops[1]`` operations; no intermediate result is negative."""
    value = rng.randint(1, max_operand)
    first, steps = value, []
    for _ in range(rng.randint(*num_ops)):
        op = rng.choice("+-") if value >= 1 else "+"
        operand = rng.randint(1, max_operand) if op == "+" else rng.randint(1, min(value, max_operand))
        value = value + operand if op == "+" else value - operand
        steps.append((op, operand))
    return first, tuple(steps)


def expression(problem: Problem) -> str:
    first, steps = problem
    return " ".join([str(first), *(f"{op} {b}" for op, b in steps)])


def worked_steps(problem: Problem) -> tuple[list[str], int]:
    """The lines ``a op b = c.`` of the left-to-right evaluation, and the result."""
    value, lines = problem[0], []
    for op, operand in problem[1]:
        new = value + operand if op == "+" else value - operand
        lines.append(f"{value} {op} {operand} = {new}.")
        value = new
    return lines, value


def problem_text(problem: Problem) -> str:
    return f"Compute {expression(problem)}."


def solution_text(problem: Problem) -> str:
    """The assistant answer in the reasoning format: ``<think>`` steps, then ``\\boxed{result}``."""
    lines, result = worked_steps(problem)
    return "<think>\n" + "\n".join(lines) + "\n</think>\n\nThe answer is \\boxed{" + str(result) + "}."


def _conversation(problem: Problem) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": problem_text(problem)},
            {"role": "assistant", "content": solution_text(problem)},
        ]
    }


def _space_bound(max_operand: int, num_ops: tuple[int, int]) -> int:
    """An upper bound on the problems of the space: a first operand, then each step one of <= 2 x max_operand."""
    return max_operand * (2 * max_operand) ** num_ops[1]


def _distinct_problems(
    rng: random.Random, n: int, max_operand: int, num_ops: tuple[int, int], exclude: set[Problem]
) -> list[Problem]:
    """``n`` distinct problems, none of ``exclude``, every problem of the space equally likely.

    Why not distinct draws of :func:`random_problem`: it makes some problems far likelier than others
    (``1 - 1 + c``: the first operand 1, a minus, then only 1 can be subtracted and only a plus can
    follow; each such problem is ~10x likelier than a typical one), so the split drawn first took them
    all. At the default setting the test file held every ``1 - 1 + c`` and 39 of 400 problems with a
    zero after the first step, the training set none of the first and 40 of 1200 of the second, and
    whether a run generalized to them moved its accuracy by 2-3 points by seed. A space small enough to
    list (the default's ~1,900 problems) is sampled uniformly; a larger one, where distinct draws
    rarely collide, by rejection."""
    found: list[Problem] = []
    if _space_bound(max_operand, num_ops) <= _LISTED_SPACE:
        pool = [p for p in sorted(_all_problems(max_operand, num_ops)) if p not in exclude]
        if len(pool) >= n:
            return rng.sample(pool, n)
        found = pool
    else:
        seen = set(exclude)
        misses = 0
        while len(found) < n and misses < _MAX_MISSES:
            p = random_problem(rng, max_operand, num_ops)
            if p in seen:
                misses += 1
            else:
                seen.add(p)
                found.append(p)
                misses = 0
        if len(found) == n:
            return found
    raise ValueError(
        f"could only find {len(found)} of {n} distinct problems with max_operand={max_operand}, "
        f"num_ops={num_ops}: raise the difficulty or lower n_train/n_test"
    )


# ----------------------------------------------------------------------------- the CPT corpus


def task_facts(max_operand: int, num_ops: tuple[int, int]) -> list[str]:
    """Every single-step fact (``a op b = c.``, a line of a worked answer) that some problem of the
    space needs, sorted: ~300 at 2 operations of 1..9."""
    return sorted({line for p in _all_problems(max_operand, num_ops) for line in worked_steps(p)[0]})


def _fact_tables(rng: random.Random, n_tables: int, facts: list[str]) -> list[str]:
    """``n_tables`` documents of ``_TABLE_LINES`` facts each, dealt from ``facts`` shuffled afresh on
    every pass: each fact appears equally often (to one), the rare ones too. Drawn from random
    problems instead, a fact like ``13 + 8 = 21.`` (a sum of ten or more, then another addition) came
    ~3x less often than one of the first step, and those were the facts trained models got wrong."""
    stream: list[str] = []
    while len(stream) < n_tables * _TABLE_LINES:
        stream += rng.sample(facts, len(facts))
    return [
        "Arithmetic facts:\n" + "\n".join(stream[i * _TABLE_LINES : (i + 1) * _TABLE_LINES])
        for i in range(n_tables)
    ]


def _worked_document(problem: Problem) -> str:
    """A worked example in the same line format as the SFT answers."""
    lines, result = worked_steps(problem)
    return f"{problem_text(problem)}\n" + "\n".join(lines) + f"\nSo {expression(problem)} = {result}."


def _chat_document(problem: Problem) -> str:
    """A worked example as the SFT conversation reads once rendered (ChatML): the layout the model
    sees at evaluation, so copying the operands from the question is learned at the right distance."""
    turns = _conversation(problem)["messages"]
    return "\n".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>" for m in turns)


def _prose_document(problem: Problem) -> str:
    """A worked example in words: the method, explained."""
    lines, result = worked_steps(problem)
    words = [str(problem[0]), *(f"{_WORDS[op]} {b}" for op, b in problem[1])]
    return (
        f"To work out {expression(problem)}, go from left to right, one operation at a time. "
        + " ".join(f"Step {i + 1}: {line}" for i, line in enumerate(lines))
        + f" So {' '.join(words)} equals {result}."
    )


def _cpt_documents(
    rng: random.Random,
    n_worked: int,
    n_tables: int,
    max_operand: int,
    num_ops: tuple[int, int],
    exclude: set[Problem],
) -> list[str]:
    """Worked examples (one in ten in prose) and fact tables (every fact of the task equally often),
    shuffled; no problem of ``exclude``."""
    worked: list[Problem] = []
    while len(worked) < n_worked:  # repeats allowed; test problems never
        p = random_problem(rng, max_operand, num_ops)
        if p not in exclude:
            worked.append(p)
    # one in ten in prose; the rest alternate between plain worked lines and rendered conversations
    kinds = (_worked_document, _chat_document)
    docs = [_prose_document(p) if i % 10 == 0 else kinds[i % 2](p) for i, p in enumerate(worked)]
    docs += _fact_tables(rng, n_tables, task_facts(max_operand, num_ops))
    rng.shuffle(docs)
    return docs


# ----------------------------------------------------------------------------- writing


def tokenizer_training_texts(paths: dict[str, Path]) -> list[str]:
    """Texts to train the demo tokenizer on: the CPT documents and every SFT turn with its role name."""
    texts = [json.loads(line)["text"] for line in paths["cpt"].read_text(encoding="utf-8").splitlines()]
    for line in paths["sft_train"].read_text(encoding="utf-8").splitlines():
        texts += [f"{m['role']}\n{m['content']}" for m in json.loads(line)["messages"]]
    return texts


def _write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def _test_record(problem: Problem, i: int, prefix: str) -> dict[str, Any]:
    return {
        "problem": problem_text(problem),
        "answer": str(worked_steps(problem)[1]),
        "id": f"{prefix}-{i:04d}",
    }


def harder(num_ops: tuple[int, int]) -> tuple[int, int]:
    """The harder split's operations per problem: one more than the most the training data has."""
    return (num_ops[1] + 1, num_ops[1] + 1)


def make_problems(
    n: int,
    seed: int = 0,
    max_operand: int = 9,
    num_ops: tuple[int, int] = (2, 2),
    exclude: Iterable[str] = (),
    prefix: str = "arith",
) -> list[dict[str, Any]]:
    """The task generator: ``n`` distinct problems as records of the math schema ``{"problem", "answer",
    "id"}`` (what ``test.jsonl`` holds, what ``infir2 eval --task math`` reads), none whose text is in
    ``exclude`` (e.g. the problems of ``test.jsonl``). Same arguments, same problems.

    ``num_ops=harder(num_ops)`` gives problems one operation longer than the training data's: the
    harder split, where a fine-tuned model has headroom (``test_hard.jsonl``)."""
    problems = _problems_excluding(n, seed, max_operand, num_ops, exclude)
    return [_test_record(p, i, prefix) for i, p in enumerate(problems)]


def make_conversations(
    n: int,
    seed: int = 0,
    max_operand: int = 9,
    num_ops: tuple[int, int] = (2, 2),
    exclude: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """``n`` distinct problems as SFT conversations (``sft_train.jsonl``'s records: system prompt,
    question, worked answer), none whose question is in ``exclude``; e.g. harder-split conversations
    to mix into an SFT (``demo --rl``'s start)."""
    return [_conversation(p) for p in _problems_excluding(n, seed, max_operand, num_ops, exclude)]


def _problems_excluding(
    n: int, seed: int, max_operand: int, num_ops: tuple[int, int], exclude: Iterable[str]
) -> list[Problem]:
    _check(max_operand, num_ops)
    rng = random.Random(seed)
    texts = set(exclude)
    skip = {p for p in _all_problems(max_operand, num_ops) if problem_text(p) in texts} if texts else set()
    return _distinct_problems(rng, n, max_operand, num_ops, skip)


def _all_problems(max_operand: int, num_ops: tuple[int, int]) -> set[Problem]:
    """Every problem of the space (small: ~2,000 at 2 operations of 1..9); for exclusions by text."""
    out: set[Problem] = set()

    def grow(first: int, value: int, steps: tuple[tuple[str, int], ...]) -> None:
        if len(steps) >= num_ops[0]:
            out.add((first, steps))
        if len(steps) == num_ops[1]:
            return
        for b in range(1, max_operand + 1):
            grow(first, value + b, (*steps, ("+", b)))
            if b <= value:
                grow(first, value - b, (*steps, ("-", b)))

    for a in range(1, max_operand + 1):
        grow(a, a, ())
    return out


def _check(max_operand: int, num_ops: tuple[int, int]) -> None:
    if not 1 <= num_ops[0] <= num_ops[1]:
        raise ValueError(f"num_ops must be (min, max) with 1 <= min <= max, got {num_ops}")
    if max_operand < 1 or max_operand * (num_ops[1] + 1) >= NUMBERS:
        raise ValueError(
            f"max_operand={max_operand} with up to {num_ops[1]} operations can reach "
            f"{NUMBERS} or more; expected 1 <= max_operand and results below {NUMBERS}"
        )


def make_demo_data(
    out_dir: str | Path,
    seed: int = 0,
    n_train: int = 1000,
    n_test: int = 200,
    n_cpt_worked: int = 1500,
    n_cpt_tables: int = 500,
    max_operand: int = 9,
    num_ops: tuple[int, int] = (2, 2),
    n_test_hard: int | None = None,
) -> dict[str, Path]:
    """Write the demo's CPT corpus, SFT conversations and test problems; returns their paths.

    Same arguments, same bytes. The CPT corpus holds ``n_cpt_worked`` worked examples and
    ``n_cpt_tables`` fact tables (16 facts each, every fact of the task equally often); the worked
    examples may repeat SFT problems but
    never test problems. ``test_hard.jsonl`` holds ``n_test_hard`` (default ``n_test``) problems of the
    harder split (``harder(num_ops)`` operations), which no training file has.
    """
    _check(max_operand, harder(num_ops))
    rng = random.Random(seed)
    test = _distinct_problems(rng, n_test, max_operand, num_ops, exclude=set())
    train = _distinct_problems(rng, n_train, max_operand, num_ops, exclude=set(test))
    cpt = _cpt_documents(rng, n_cpt_worked, n_cpt_tables, max_operand, num_ops, exclude=set(test))
    hard = _distinct_problems(
        rng, n_test if n_test_hard is None else n_test_hard, max_operand, harder(num_ops), exclude=set()
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / f"{name}.jsonl" for name in ("cpt", "sft_train", "test", "test_hard")}
    _write_jsonl(paths["cpt"], ({"text": doc} for doc in cpt))
    _write_jsonl(paths["sft_train"], map(_conversation, train))
    _write_jsonl(paths["test"], (_test_record(p, i, "arith") for i, p in enumerate(test)))
    _write_jsonl(paths["test_hard"], (_test_record(p, i, "arith-hard") for i, p in enumerate(hard)))
    paths["readme"] = out / "README.md"
    paths["readme"].write_text(_readme(seed, n_train, n_test, len(cpt), max_operand, num_ops))
    return paths


def _readme(
    seed: int, n_train: int, n_test: int, n_cpt: int, max_operand: int, num_ops: tuple[int, int]
) -> str:
    return (
        "# infir2 demo data (generated)\n\n"
        f"Written by `infir2.tools.demo.data.make_demo_data(seed={seed}, n_train={n_train}, n_test={n_test}, "
        f"max_operand={max_operand}, num_ops={num_ops})`.\n\n"
        '- `cpt.jsonl`: continual pre-training corpus, {"text"} per line '
        f"({n_cpt} documents: arithmetic fact tables, worked examples).\n"
        '- `sft_train.jsonl`: SFT conversations, {"messages": [system, user, assistant]}.\n'
        '- `test.jsonl`: held-out problems, {"problem", "answer", "id"}; none appears in the files above.\n'
        f"- `test_hard.jsonl`: the harder split, problems with {harder(num_ops)[0]} operations (same schema).\n\n"
        "Licence: synthetic data generated by code from a random seed; no third-party content. "
        "Apache-2.0, as the infir2 code.\n"
    )
