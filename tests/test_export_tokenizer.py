"""A run's exported folder tokenizes as the run trained: ``AutoTokenizer`` on ``<run>/hf`` and on its FP8
export gives exactly the ids of the run's training shards, even from an ambiguous source folder."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import yaml
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from conftest import make_tiny_model
from infir2.cli import main
from infir2.data import check_tokenized_by, load_tokenizer, prepare_cpt
from infir2.data.cpt import is_val_document
from train_synthetic import one_thread

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

_one_thread = pytest.fixture(autouse=True)(one_thread)

DOCS = [f"In {1100 + 3 * i} the clerk counted {20 * i + 13} coins and {i}99 pies." for i in range(40)]


def _digit_run_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE that keeps digit runs together ("1133" can be one token), as many users' are."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


@pytest.fixture
def user_folder(tmp_path):
    """A user's own Qwen2 folder whose tokenizer.json and AutoTokenizer's Qwen2 class disagree on digits."""
    folder = tmp_path / "user-qwen2"
    tokenizer = _digit_run_tokenizer()
    tokenizer.save_pretrained(folder)
    make_tiny_model("qwen2", vocab_size=len(tokenizer)).save_pretrained(folder)
    as_saved = tokenizer("1133 coins", add_special_tokens=False)["input_ids"]
    as_auto = AutoTokenizer.from_pretrained(folder)("1133 coins", add_special_tokens=False)["input_ids"]
    assert as_saved != as_auto  # the ambiguity this test is about
    return folder


def _train_documents(data_dir) -> list[list[int]]:
    tokens = np.fromfile(
        data_dir / "train.bin", dtype=json.loads((data_dir / "meta.json").read_text())["dtype"]
    )
    eos = AutoTokenizer.from_pretrained(data_dir.parent / "user-qwen2").eos_token_id
    ends = np.flatnonzero(tokens == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[s:e].tolist() for s, e in zip(starts, ends, strict=True)]


@pytest.mark.slow
def test_export_and_fp8_export_tokenize_as_the_run_trained(user_folder, tmp_path, caplog):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    data = tmp_path / "cpt"
    with caplog.at_level(logging.WARNING):
        assert (
            main(
                [
                    "prepare-cpt",
                    "--tokenizer",
                    str(user_folder),
                    "--out",
                    str(data),
                    "--val-fraction",
                    "0.1",
                    "--no-progress",
                    str(corpus),
                ]
            )
            == 0
        )
    assert "is ambiguous" in caplog.text and "Qwen2Tokenizer" in caplog.text  # said at prepare-cpt

    config = {
        "run": {"name": "r", "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "model": {"path": str(user_folder), "precision": "fp32"},
        "fp8": {"recipe": "blockwise"},
        "data": {"kind": "cpt", "train_path": str(data), "seq_len": 16, "global_batch_size": 2},
        "train": {"max_steps": 1},
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(config))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["train", str(tmp_path / "r.yaml"), "--no-progress"]) == 0
    assert "is ambiguous" in caplog.text  # and at train start
    hf = tmp_path / "runs" / "r" / "hf"
    assert main(["export", "--model", str(hf), "--out", str(tmp_path / "fp8"), "--format", "fp8"]) == 0

    train_texts = [d for i, d in enumerate(DOCS) if not is_val_document(i, 0.1)]
    trained = _train_documents(data)
    assert len(trained) == len(train_texts)
    for folder in (hf, tmp_path / "fp8"):
        downstream = AutoTokenizer.from_pretrained(folder)
        assert [downstream(t, add_special_tokens=False)["input_ids"] for t in train_texts] == trained, folder


def test_shards_from_another_reading_are_refused(user_folder, tmp_path):
    """Shards tokenized with the folder's tokenizer.json reading fail the check against the export's."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    as_saved = PreTrainedTokenizerFast.from_pretrained(user_folder)
    prepare_cpt([corpus], tmp_path / "saved", as_saved, val_fraction=0.1, progress=False)
    check_tokenized_by(as_saved, tmp_path / "saved")  # consistent with itself
    with pytest.raises(ValueError, match=r"data.train_path: .*prepare-cpt"):
        check_tokenized_by(load_tokenizer(user_folder), tmp_path / "saved")


def test_model_type_reads_a_tokenizer_only_folder_as_the_export_will(user_folder, tmp_path):
    """A from_config run names the arch; its tokenizer folder has no config.json."""
    tok_only = tmp_path / "tok"
    _digit_run_tokenizer().save_pretrained(tok_only)
    text = " ".join(DOCS[:3])
    expected = AutoTokenizer.from_pretrained(user_folder)(text)["input_ids"]  # a qwen2 folder's reading
    assert load_tokenizer(tok_only, model_type="qwen2")(text)["input_ids"] == expected
    assert (
        load_tokenizer(tok_only)(text)["input_ids"]
        == AutoTokenizer.from_pretrained(tok_only)(text)["input_ids"]
    )
