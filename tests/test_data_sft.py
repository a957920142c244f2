"""SFT data: loading errors, loss masking (the public render function), token-budgeted batching."""

from __future__ import annotations

import json

import pytest
import torch

from infir2.data import IGNORE_INDEX, SftSource, count_loss_tokens, load_conversations, render_conversation

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

SYSTEM = {"role": "system", "content": "Please reason step by step."}
USER1 = {"role": "user", "content": "What is 12 + 30?"}
ASSISTANT1 = {
    "role": "assistant",
    "content": "<think>\n12 + 30 = 42.\n</think>\n\nThe answer is \\boxed{42}.",
}
USER2 = {"role": "user", "content": "And 7 * 6?"}
ASSISTANT2 = {"role": "assistant", "content": "Also 42."}

# A Llama-3-style template: different markers, trims content, bos in the template, no newline after turns.
LLAMA3_LIKE = (
    "<|im_start|>{% for m in messages %}<|endoftext|>{{ m['role'] }}\n\n{{ m['content'] | trim }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|endoftext|>assistant\n\n{% endif %}"
)

# Qwen2.5's template (tool branches left out): a default system prompt when there is none.
QWEN25_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def loss_spans(tokenizer, ids, mask):
    """Decoded text of each maximal run of loss tokens."""
    spans, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            spans.append(tokenizer.decode(cur))
            cur = []
    return spans + ([tokenizer.decode(cur)] if cur else [])


@pytest.mark.parametrize(
    "messages",
    [[USER1, ASSISTANT1], [SYSTEM, USER1, ASSISTANT1], [SYSTEM, USER1, ASSISTANT1, USER2, ASSISTANT2]],
    ids=["single", "system", "multi-turn"],
)
def test_only_assistant_tokens_carry_loss(tiny_tokenizer, messages):
    ids, mask = render_conversation(tiny_tokenizer, messages)
    # independent reference: ChatML written by hand
    chatml = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert tiny_tokenizer.decode(ids) == chatml and len(mask) == len(ids)
    answers = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert loss_spans(tiny_tokenizer, ids, mask) == answers
    no_loss = tiny_tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    expected = "".join(
        f"<|im_start|>{m['role']}\n"
        + ("" if m["role"] == "assistant" else m["content"] + "<|im_end|>")
        + "\n"
        for m in messages
    )
    assert no_loss == expected  # system/user turns, headers and separators never carry loss


def test_other_template(tiny_tokenizer):
    messages = [SYSTEM, USER1, {"role": "assistant", "content": "  42 \n"}, USER2, ASSISTANT2]
    tok = tiny_tokenizer.__class__(tokenizer_object=tiny_tokenizer.backend_tokenizer)
    tok.chat_template = LLAMA3_LIKE
    ids, mask = render_conversation(tok, messages)
    assert loss_spans(tok, ids, mask) == ["42<|im_end|>", "Also 42.<|im_end|>"]


def test_qwen_template_with_default_system_prompt(tiny_tokenizer):
    tok = tiny_tokenizer.__class__(tokenizer_object=tiny_tokenizer.backend_tokenizer)
    tok.chat_template = QWEN25_LIKE
    ids, mask = render_conversation(tok, [USER1, ASSISTANT1, USER2, ASSISTANT2])
    assert tok.decode(ids).startswith("<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n")
    assert loss_spans(tok, ids, mask) == [ASSISTANT1["content"] + "<|im_end|>", "Also 42.<|im_end|>"]


def test_template_that_rewrites_history_is_rejected(tiny_tokenizer):
    tok = tiny_tokenizer.__class__(tokenizer_object=tiny_tokenizer.backend_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}{{ messages | length }}:{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="prefix by prefix"):
        render_conversation(tok, [USER1, ASSISTANT1])


def test_max_length_truncates(tiny_tokenizer):
    ids, mask = render_conversation(tiny_tokenizer, [SYSTEM, USER1, ASSISTANT1])
    short_ids, short_mask = render_conversation(tiny_tokenizer, [SYSTEM, USER1, ASSISTANT1], max_length=30)
    assert short_ids == ids[:30] and short_mask == mask[:30]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"messages": [{"role": "user", "content": "hi"}, ', r"c\.jsonl:2: invalid JSON"),
        ('{"msgs": []}', r"c\.jsonl:2: missing 'messages'"),
        ('{"messages": []}', r"c\.jsonl:2: 'messages' must be a non-empty list"),
        (
            '{"messages": [{"role": "bot", "content": "x"}]}',
            r"c\.jsonl:2: messages\[0\]\.role is 'bot'; expected one",
        ),
        (
            '{"messages": [{"role": "user", "content": 3}]}',
            r"c\.jsonl:2: messages\[0\]\.content must be a string, got int",
        ),
        (
            '{"messages": [{"role": "user", "content": "hi"}]}',
            r"c\.jsonl:2: conversation has no assistant turn",
        ),
        ('{"messages": ["hi"]}', r"c\.jsonl:2: messages\[0\]: expected an object"),
    ],
)
def test_malformed_conversations_name_file_and_line(tmp_path, content, match):
    good = json.dumps({"messages": [USER1, ASSISTANT1]})
    (tmp_path / "c.jsonl").write_text(f"{good}\n{content}\n")
    with pytest.raises(ValueError, match=match):
        load_conversations(tmp_path / "c.jsonl")


def test_empty_and_missing_file(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"e\.jsonl: empty file"):
        load_conversations(tmp_path / "e.jsonl")
    with pytest.raises(FileNotFoundError, match="nope"):
        load_conversations(tmp_path / "nope.jsonl")


def test_load_round_trip(tmp_path):
    rows = [{"messages": [SYSTEM, USER1, ASSISTANT1], "id": 1}, {"messages": [USER2, ASSISTANT2]}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_conversations(tmp_path / "c.jsonl") == [r["messages"] for r in rows]


def make_conversations(n: int) -> list[list[dict[str, str]]]:
    """Conversations of varied length (about 20 to 130 tokens)."""
    return [
        [
            {"role": "user", "content": f"Add {i} and {i % 7}." + " Please" * (i % 5)},
            {"role": "assistant", "content": f"{i} + {i % 7} = {i + i % 7}." + " Indeed" * (i % 11)},
        ]
        for i in range(n)
    ]


def rows_of(step):
    """(input_ids, labels) of every real row of a step, padding stripped."""
    out = []
    for mb in step:
        for ids, labels, att in zip(mb["input_ids"], mb["labels"], mb["attention_mask"], strict=True):
            n = int(att.sum())
            assert att[:n].all() and not att[n:].any()  # right padding
            if (labels != IGNORE_INDEX).any():
                out.append((tuple(ids[:n].tolist()), tuple(labels[:n].tolist())))
    return out


def test_budget_labels_and_epoch_coverage(tiny_tokenizer):
    convs = make_conversations(50)
    source = SftSource(
        convs, tiny_tokenizer, 8, max_tokens_per_micro_batch=256, max_length=200, epochs=2, progress=False
    )
    assert source.steps_per_epoch == 6 and source.total_steps == 12
    expected = {}
    for c in convs:
        ids, mask = render_conversation(tiny_tokenizer, c)
        expected[tuple(ids)] = tuple(i if m else IGNORE_INDEX for i, m in zip(ids, mask, strict=True))
    steps = list(source)
    assert len(steps) == 12
    for epoch in (steps[:6], steps[6:]):
        seen = [r for step in epoch for r in rows_of(step)]
        assert len(seen) == 48 and len({ids for ids, _ in seen}) == 48  # each sample at most once per epoch
        assert all(expected[ids] == labels for ids, labels in seen)
    for step in steps:
        assert len(rows_of(step)) == 8
        for mb in step:
            assert mb["input_ids"].numel() <= 256
            assert (mb["input_ids"][mb["attention_mask"] == 0] == tiny_tokenizer.pad_token_id).all()
    assert [rows_of(s) for s in steps[:6]] != [rows_of(s) for s in steps[6:]]  # reshuffled per epoch


def test_ranks_same_micro_batch_count(tiny_tokenizer):
    convs = make_conversations(64)
    kw = dict(global_batch_size=8, max_tokens_per_micro_batch=160, max_length=150, seed=1, progress=False)
    single = list(SftSource(convs, tiny_tokenizer, **kw))
    ranks = [list(SftSource(convs, tiny_tokenizer, rank=r, world_size=2, **kw)) for r in (0, 1)]
    padded = 0
    for one, r0, r1 in zip(single, *ranks, strict=True):
        assert len(r0) == len(r1)  # FSDP collectives line up
        assert sorted(rows_of(r0) + rows_of(r1)) == sorted(rows_of(one))  # a partition of the global batch
        assert count_loss_tokens(r0) + count_loss_tokens(r1) == count_loss_tokens(one)
        tokens = [sum(int(mb["attention_mask"].sum()) for mb in r) for r in (r0, r1)]
        assert abs(tokens[0] - tokens[1]) <= 150  # balanced to within one sample
        for mb in r0 + r1:
            if (mb["labels"] == IGNORE_INDEX).all():
                padded += 1
                assert mb["attention_mask"].all()  # no fully masked rows
    assert padded > 0  # the case was exercised


def test_overlong_truncate_and_drop(tiny_tokenizer):
    convs = make_conversations(40)
    lengths = [len(render_conversation(tiny_tokenizer, c)[0]) for c in convs]
    limit = sorted(lengths)[30]
    n_long = sum(n > limit for n in lengths)
    drop = SftSource(convs, tiny_tokenizer, 4, 512, limit, overlong="drop", progress=False)
    assert drop.stats["dropped_overlong"] == n_long and drop.stats["samples"] == 40 - n_long
    trunc = SftSource(convs, tiny_tokenizer, 4, 512, limit, overlong="truncate", progress=False)
    assert trunc.stats["truncated"] == n_long and trunc.stats["samples"] == 40
    assert max(len(ids) for ids, _ in trunc.samples) == limit
    first_loss = [render_conversation(tiny_tokenizer, c)[1].index(1) for c in convs]
    cut = sorted(first_loss)[20]  # cut there: about half the samples lose their whole answer
    short = SftSource(convs, tiny_tokenizer, 4, 512, max_length=cut, progress=False)
    assert short.stats["dropped_no_loss"] == sum(i >= cut for i in first_loss) == 40 - short.stats["samples"]
    assert 0 < short.stats["dropped_no_loss"] < 40
    with pytest.raises(ValueError, match="overlong must be"):
        SftSource(convs, tiny_tokenizer, 4, 512, limit, overlong="skip", progress=False)
    with pytest.raises(ValueError, match="max_length=600 exceeds max_tokens_per_micro_batch=512"):
        SftSource(convs, tiny_tokenizer, 4, 512, 600, progress=False)
    with pytest.raises(ValueError, match="fewer than global_batch_size=64"):
        SftSource(convs, tiny_tokenizer, 64, 512, 200, progress=False)


def test_resume_is_exact(tiny_tokenizer):
    convs = make_conversations(30)
    kw = dict(
        global_batch_size=4, max_tokens_per_micro_batch=200, max_length=150, epochs=3, seed=5, progress=False
    )
    full = list(SftSource(convs, tiny_tokenizer, **kw))
    first = SftSource(convs, tiny_tokenizer, **kw)
    it = iter(first)
    head = [next(it) for _ in range(10)]  # crosses the epoch boundary (7 steps per epoch)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = SftSource(convs, tiny_tokenizer, **kw | {"seed": 0})
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert len(head + tail) == len(full) == 21
    for a, b in zip(full, head + tail, strict=True):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "labels", "attention_mask"))
    with pytest.raises(ValueError, match="num_samples was 28"):
        SftSource(make_conversations(31), tiny_tokenizer, **kw).load_state_dict({**state, "num_samples": 28})


def test_non_utf8_conversations_name_file_and_line(tmp_path):
    good = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    )
    path = tmp_path / "chat.jsonl"
    path.write_bytes(good.encode() + b"\n" + good.encode().replace(b"hi", b"h\xffi") + b"\n")
    with pytest.raises(ValueError, match=r"chat\.jsonl:2: not valid UTF-8 \(byte 0xff\)"):
        load_conversations(path)


def test_conversations_load_from_parquet(tmp_path):
    """A `messages` column, as `datasets` writes chat data (it was read as JSONL: "not valid UTF-8")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ],
    ]
    pq.write_table(pa.table({"messages": rows, "id": [7, 8]}), tmp_path / "chat.parquet")
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    assert load_conversations(tmp_path / "chat.parquet") == load_conversations(jsonl)
    pq.write_table(pa.table({"chat": rows}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match=r"other\.parquet: no column 'messages'.*\['chat'\]"):
        load_conversations(tmp_path / "other.parquet")
    bad = [[{"role": "user", "content": "hi"}]]
    pq.write_table(pa.table({"messages": bad}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: row 1: conversation has no assistant turn"):
        load_conversations(tmp_path / "bad.parquet")
