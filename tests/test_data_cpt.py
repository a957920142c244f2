"""CPT data: prepare shards (round trip, split, errors), training windows (resume), validation batches."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter

import numpy as np
import pytest

from infir2.cli import main as cli_main
from infir2.data import IGNORE_INDEX, CptSource, load_cpt_meta, load_tokens, prepare_cpt, val_batches
from infir2.data.cpt import token_dtype

DOCS = [f"Document {i}: {i} + {i + 1} = {2 * i + 1}. " + "word " * (i % 7) for i in range(40)]


@pytest.fixture
def corpus(tmp_path):
    """DOCS spread over a .txt file, a .jsonl file (with an empty record) and a .parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text(DOCS[0])
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS[1:20])]
    lines.insert(3, json.dumps({"text": "   "}))  # empty document: skipped, counted
    (src / "b.jsonl").write_text("\n".join(lines) + "\n\n")
    pq.write_table(pa.table({"text": DOCS[20:]}), src / "sub" / "c.parquet")
    return src


def split_docs(tokens: np.ndarray, eos: int) -> list[list[int]]:
    assert len(tokens) and tokens[-1] == eos  # every document is followed by EOS
    docs, cur = [], []
    for t in tokens.tolist():
        if t == eos:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    return docs


def test_round_trip(corpus, tmp_path, tiny_tokenizer):
    meta = prepare_cpt([corpus], tmp_path / "out", tiny_tokenizer, val_fraction=0.1, progress=False)
    eos = tiny_tokenizer.eos_token_id
    train = split_docs(load_tokens(tmp_path / "out", "train"), eos)
    val = split_docs(load_tokens(tmp_path / "out", "val"), eos)
    # independent reference: each document tokenized on its own
    expected = [tiny_tokenizer(d, add_special_tokens=False)["input_ids"] for d in DOCS]
    assert len(val) == math.ceil(len(DOCS) * 0.1) == meta["val_documents"]
    assert sorted(train + val) == sorted(expected)  # nothing lost, nothing duplicated: split is disjoint
    assert train == [d for d in expected if d not in val]  # order kept
    assert [tiny_tokenizer.decode(d) for d in val] == [DOCS[i] for i in range(0, 40, 10)]  # evenly spread
    assert meta["skipped_empty"] == 1 and meta["train_documents"] + meta["val_documents"] == len(DOCS)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == len(tiny_tokenizer)
    assert meta["train_tokens"] == sum(len(d) + 1 for d in train)
    assert [p.rsplit("/", 1)[-1] for p in meta["sources"]] == ["a.txt", "b.jsonl", "c.parquet"]
    assert load_cpt_meta(tmp_path / "out") == meta
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_prepare_is_deterministic(corpus, tmp_path, tiny_tokenizer):
    for name in ("x", "y"):
        prepare_cpt([corpus], tmp_path / name, tiny_tokenizer, val_fraction=0.2, progress=False)
    for f in ("train.bin", "val.bin"):
        assert (tmp_path / "x" / f).read_bytes() == (tmp_path / "y" / f).read_bytes()


def test_token_dtype():
    assert token_dtype(65535).name == "uint16" and token_dtype(65536).name == "uint32"
    assert token_dtype(151_936).str == "<u4"  # Qwen2.5 vocabulary, little-endian on disk


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"text": "ok"}\n{"text": "fine"}\n{"text": broken\n', r"bad\.jsonl:3: invalid JSON"),
        ('{"text": "ok"}\n{"body": "x"}\n', r"bad\.jsonl:2: missing field 'text'"),
        ('{"text": 5}\n', r"bad\.jsonl:1: field 'text' must be a string, got int"),
        ("[1, 2]\n", r"bad\.jsonl:1: expected a JSON object"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, tiny_tokenizer, line, match):
    (tmp_path / "bad.jsonl").write_text(line)
    with pytest.raises(ValueError, match=match):
        prepare_cpt([tmp_path / "bad.jsonl"], tmp_path / "out", tiny_tokenizer, progress=False)
    assert not (tmp_path / "out" / "meta.json").exists()
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_other_input_errors(tmp_path, tiny_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p\.parquet: no column 'text'"):
        prepare_cpt([tmp_path / "p.parquet"], tmp_path / "o", tiny_tokenizer, progress=False)
    pq.write_table(pa.table({"text": ["x", None]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"n\.parquet: row 2: column 'text' must be a string, got NoneType"):
        prepare_cpt([tmp_path / "n.parquet"], tmp_path / "o", tiny_tokenizer, progress=False)
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match=r"x\.csv: unsupported file type"):
        prepare_cpt([tmp_path / "x.csv"], tmp_path / "o", tiny_tokenizer, progress=False)
    with pytest.raises(FileNotFoundError, match="missing"):
        prepare_cpt([tmp_path / "missing"], tmp_path / "o", tiny_tokenizer, progress=False)
    (tmp_path / "e.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="no training documents"):
        prepare_cpt([tmp_path / "e.jsonl"], tmp_path / "o", tiny_tokenizer, progress=False)
    with pytest.raises(FileNotFoundError, match="prepare-cpt"):
        CptSource(tmp_path / "o", seq_len=8, global_batch_size=2, micro_batch_size=1)


@pytest.fixture
def prepared(corpus, tmp_path, tiny_tokenizer):
    prepare_cpt([corpus], tmp_path / "data", tiny_tokenizer, val_fraction=0.25, progress=False)
    return tmp_path / "data"


def take(source, n):
    it = iter(source)
    return [next(it) for _ in range(n)]


def test_windows(prepared):
    seq_len, gbs = 16, 4
    tokens = load_tokens(prepared)
    source = CptSource(prepared, seq_len, global_batch_size=gbs, micro_batch_size=2)
    windows = Counter(
        tuple(tokens[i * seq_len : (i + 1) * seq_len].tolist()) for i in range(len(tokens) // seq_len)
    )
    seen = []
    for step in take(source, source.steps_per_epoch):
        assert len(step) == 2
        for mb in step:
            assert mb["input_ids"].shape == (2, seq_len) and mb["input_ids"].dtype.is_signed
            assert mb["input_ids"].equal(mb["labels"])
            seen += [tuple(row) for row in mb["input_ids"].tolist()]
    assert len(seen) == source.steps_per_epoch * gbs
    assert Counter(seen) <= windows  # each window at most once per epoch (some windows have equal content)
    assert source.state_dict()["epoch"] == 1


def test_ranks_partition_the_global_batch(prepared):
    def rows(source, steps):
        return [[tuple(r) for mb in step for r in mb["input_ids"].tolist()] for step in take(source, steps)]

    single = rows(CptSource(prepared, 8, 8, 2, seed=3), 5)
    r0 = rows(CptSource(prepared, 8, 8, 2, rank=0, world_size=2, seed=3), 5)
    r1 = rows(CptSource(prepared, 8, 8, 4, rank=1, world_size=2, seed=3), 5)
    assert [a + b for a, b in zip(r0, r1, strict=True)] == single


def test_resume_is_exact(prepared):
    def run(source, steps):
        return [[mb["input_ids"] for mb in step] for step in take(source, steps)]

    full = CptSource(prepared, 16, 4, 2, seed=7)
    n = full.steps_per_epoch + 3  # crosses an epoch boundary
    uninterrupted = run(full, 2 * n)
    first = CptSource(prepared, 16, 4, 2, seed=7)
    head = run(first, n)
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = CptSource(prepared, 16, 4, 2, seed=0)
    resumed.load_state_dict(state)
    tail = run(resumed, n)
    for a, b in zip(uninterrupted, head + tail, strict=True):
        assert all(x.equal(y) for x, y in zip(a, b, strict=True))
    other_epoch = run(CptSource(prepared, 16, 4, 2, seed=8), 1)[0]
    assert not all(x.equal(y) for x, y in zip(other_epoch, uninterrupted[0], strict=True))  # seed matters
    with pytest.raises(ValueError, match="seq_len was 16 and is now 8"):
        CptSource(prepared, 8, 4, 2).load_state_dict(state)


def test_batch_shape_errors(prepared):
    with pytest.raises(ValueError, match="not divisible by world_size=3"):
        CptSource(prepared, 16, 4, 1, world_size=3)
    with pytest.raises(ValueError, match="not divisible by micro_batch_size=3"):
        CptSource(prepared, 16, 4, 3)
    with pytest.raises(ValueError, match="one step needs global_batch_size=4096 windows"):
        CptSource(prepared, 16, 4096, 1)


def test_val_batches(prepared):
    """Held-out windows: L+1 tokens sharing boundaries, so every token after the first is a target once."""
    tokens = load_tokens(prepared, "val")
    batches = list(val_batches(prepared, 8, batch_size=3))
    targets = np.concatenate([b["labels"][:, 1:].reshape(-1).numpy() for b in batches])
    assert (targets[targets != IGNORE_INDEX] == tokens[1:]).all()
    starts = np.concatenate([b["input_ids"][:, 0].numpy() for b in batches])
    assert (starts == tokens[0 : len(tokens) - 1 : 8]).all()  # window w starts at token w * L
    assert all(b["input_ids"].shape[1] <= 9 for b in batches)
    assert all(((b["labels"] == IGNORE_INDEX) == (b["attention_mask"] == 0)).all() for b in batches)
    assert len(list(val_batches(prepared, 8, batch_size=3, max_batches=2))) == 2
    for world in (2, 3, len(starts) + 1):  # uneven counts, and more ranks than batches
        per_rank = [list(val_batches(prepared, 8, 1, rank=r, world_size=world)) for r in range(world)]
        assert len({len(b) for b in per_rank}) == 1  # the same number of forwards on every rank
        scored = [b["labels"] for rank in per_rank for b in rank if (b["labels"] != IGNORE_INDEX).any()]
        assert sorted(t.tolist() for t in scored) == sorted(
            b["labels"].tolist() for b in val_batches(prepared, 8, 1)
        )
    (prepared.parent / "one").mkdir()
    (prepared.parent / "one" / "meta.json").write_text((prepared / "meta.json").read_text())
    tokens[:1].tofile(prepared.parent / "one" / "val.bin")
    with pytest.raises(ValueError, match="at least 2"):
        next(val_batches(prepared.parent / "one", 8, 1))


def test_command(corpus, tmp_path, capsys):
    from infir2.data.tokenizer import train_bpe_tokenizer

    train_bpe_tokenizer(DOCS, vocab_size=300).save_pretrained(tmp_path / "tok")
    args = [
        "prepare-cpt",
        "--tokenizer",
        str(tmp_path / "tok"),
        "--out",
        str(tmp_path / "o"),
        "--no-progress",
    ]
    assert cli_main([*args, "--val-fraction", "0.5", str(corpus)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["skipped_empty"] == 1
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    assert cli_main([*args, str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:1: missing field 'text'" in capsys.readouterr().err


def test_bad_input_leaves_a_good_dataset_byte_identical(corpus, tmp_path, tiny_tokenizer):
    out = tmp_path / "data"
    prepare_cpt([corpus], out, tiny_tokenizer, val_fraction=0.25, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        prepare_cpt([tmp_path / "bad.jsonl"], out, tiny_tokenizer, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "data", "src"]  # no temporary left
    # a good rerun into the same folder replaces the dataset
    meta = prepare_cpt([corpus], out, tiny_tokenizer, val_fraction=0.5, progress=False)
    assert load_cpt_meta(out) == meta and meta["val_fraction"] == 0.5


@pytest.mark.parametrize(
    ("name", "data", "match"),
    [
        ("t.txt", b"first line\nsecond \xff line\n", r"t\.txt:2: not valid UTF-8 \(byte 0xff\)"),
        ("j.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"j\.jsonl:2: not valid UTF-8 \(byte 0xe9\)"),
    ],
)
def test_non_utf8_input_names_file_and_line(tmp_path, tiny_tokenizer, name, data, match):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=match):
        prepare_cpt([tmp_path / name], tmp_path / "out", tiny_tokenizer, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_folder_parquet_without_the_text_column_is_skipped(tmp_path, tiny_tokenizer, caplog):
    """A dataset folder often holds other tables beside the text; a file named explicitly still fails."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"text": ["one document", "another one"]}), tmp_path / "data" / "text.parquet")
    pq.write_table(pa.table({"id": [1, 2], "label": ["a", "b"]}), tmp_path / "data" / "labels.parquet")
    with caplog.at_level(logging.WARNING):
        meta = prepare_cpt(
            [tmp_path / "data"], tmp_path / "out", tiny_tokenizer, val_fraction=0, progress=False
        )
    assert meta["train_documents"] == 2
    assert [s.rsplit("/", 1)[-1] for s in meta["sources"]] == ["text.parquet"]
    assert "skipping" in caplog.text and "labels.parquet" in caplog.text and "['id', 'label']" in caplog.text
    with pytest.raises(ValueError, match=r"labels\.parquet: no column 'text'"):
        prepare_cpt([tmp_path / "data" / "labels.parquet"], tmp_path / "o2", tiny_tokenizer, progress=False)
