"""The bad inputs benchmarks/bad_input_probe.py found without one clear line (issue 28), each now refused in
one line that names the file, key or flag (exit 2) and leaves nothing behind: YAML configs that do not
parse, are not UTF-8, are empty, give a key twice or are a folder; a broken tokenizer folder; an odd-sized
train.bin; a benchmark that is not UTF-8 or is a folder; sizes a model cannot have; an unknown FP8 backend;
command-line counts below one; held-out windows past the model's positions."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from conftest import make_tiny_model, make_tokenizer
from infir2.cli import main
from infir2.data import load_tokenizer
from infir2.data.tokens import load_tokens
from infir2.eval.perplexity import evaluate_loss
from infir2.tasks import load_problems
from infir2.train.config import parse_config
from train_synthetic import one_thread, prepared_cpt, tiny_cpt_sections

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _one_line(capsys, argv: list[str], *needles: str) -> str:
    """``infir2 argv`` exits 2 with exactly one stderr line, holding every needle."""
    rc = main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and all(n in lines[0] for n in needles), (rc, lines)
    return lines[0]


@pytest.fixture
def cpt(tmp_path):
    return tmp_path, tiny_cpt_sections(tmp_path)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            "run: {name: x\noptim: [1,\n",
            ":2:6: not valid YAML (while parsing a flow mapping",
        ),  # was 8 lines, a '^'
        ("run:\n\tname: x\n", ":2:1: not valid YAML"),
        (b"run:\n  name: caf\xe9\n", ":2: not valid UTF-8 (byte 0xe9)"),  # was the codec's text, no file
        ("", ": empty file"),  # was "data.train_path: is required"
    ],
)
def test_a_config_that_does_not_read_is_named_with_its_line(tmp_path, capsys, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    for command in ("train", "rl", "config"):
        _one_line(capsys, [command, str(path)], f"{path}{needle}")


def test_a_key_given_twice_is_refused_not_silently_the_last(cpt, capsys):
    tmp_path, cfg = cpt
    path = tmp_path / "twice.yaml"
    path.write_text(yaml.safe_dump(cfg) + "run:\n  name: other\n")  # PyYAML alone keeps the second `run`
    _one_line(capsys, ["train", str(path), "--no-progress"], f"{path}:", "key 'run' appears twice")
    assert not (tmp_path / "runs").exists()


def test_a_folder_given_for_a_file_says_so(cpt, capsys):
    tmp_path, cfg = cpt
    _one_line(capsys, ["train", str(tmp_path / "cpt")], "is a folder, not a YAML file")
    _one_line(capsys, ["rl", str(tmp_path / "cpt")], "is a folder, not a YAML file")
    with pytest.raises(ValueError, match="is a folder, not a benchmark JSONL file"):
        load_problems(tmp_path / "cpt", "math")
    sft = {
        "kind": "sft",
        "train_path": str(tmp_path / "cpt"),
        "max_tokens_per_micro_batch": 64,
        "max_length": 64,
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({**cfg, "data": sft}))
    _one_line(
        capsys, ["train", str(path), "--no-progress"], "data.train_path", "is a folder; SFT data is a JSONL"
    )
    model_file = tmp_path / "a-file"
    model_file.write_text("x")
    _one_line(capsys, ["eval", "--model", str(model_file)], f"model folder {model_file} is a file")


def test_a_benchmark_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"problem": "1", "answer": "1"}\n{"problem": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: not valid UTF-8 \(byte 0xe9\)"):
        load_problems(path, "math")


def test_a_broken_tokenizer_folder_is_named(tmp_path):
    make_tokenizer().save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"tokenizer folder {tmp_path / 'tok'}: its files cannot be read"):
        load_tokenizer(tmp_path / "tok")


def test_an_odd_sized_token_file_is_named(tmp_path):
    _, data = prepared_cpt(tmp_path, documents=50)
    with open(data / "train.bin", "ab") as f:
        f.write(b"\x01")  # numpy said "Size of available data is not a multiple of the data-type size."
    with pytest.raises(ValueError, match=rf"{data / 'train.bin'}: \d+ bytes is not a whole number of uint16"):
        load_tokens(data, "train")


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("hidden_size", -64, "model.from_config.hidden_size: must be > 0, got -64"),  # was a torch traceback
        ("num_attention_heads", 3, "model.from_config: LlamaConfig rejects"),  # was huggingface_hub's
    ],
)
def test_sizes_a_model_cannot_have_are_one_line(cpt, capsys, key, value, needle):
    tmp_path, cfg = cpt
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(cfg))
    _one_line(
        capsys, ["train", str(path), "--no-progress", "--set", f"model.from_config.{key}={value}"], needle
    )
    assert not (tmp_path / "runs").exists()  # the run.out_dir this start made is gone too


def test_an_unknown_fp8_backend_is_refused():
    with pytest.raises(ValueError, match=r"fp8.backend: got 'magic', expected one of emulated"):
        parse_config({"fp8": {"backend": "magic"}}, "t.yaml")  # was accepted, and ignored with bf16


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["config", "tiny-cpt", "--world-size", "0"], "--world-size: must be >= 1, got 0"),
        (["memory", "--tokens", "0"], "--tokens: must be >= 1, got 0"),  # was a reshape traceback
        (["bench", "--iters", "0", "--device", "cpu"], "--iters: must be >= 1, got 0"),  # was the preset's
        (["bench", "--tokens", "-1", "--device", "cpu"], "--tokens: must be >= 1, got -1"),
    ],
)
def test_counts_below_one_name_their_flag(capsys, argv, needle):
    _one_line(capsys, argv, needle)


def test_prepare_cpt_refusals_leave_no_folder(tmp_path, capsys):
    make_tokenizer().save_pretrained(tmp_path / "tok")
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    out = tmp_path / "new" / "cpt"
    argv = ["prepare-cpt", str(bad), "--tokenizer", str(tmp_path / "tok"), "--out", str(out), "--no-progress"]
    _one_line(capsys, argv, f"{bad}:2: not valid UTF-8")
    assert not (tmp_path / "new").exists()  # the parent it made for --out is removed again
    _one_line(capsys, [*argv, "--val-fraction", "1.5"], "--val-fraction: must be in [0, 1), got 1.5")


def test_held_out_windows_past_the_models_positions_are_refused(tmp_path):
    tok, data = prepared_cpt(tmp_path, documents=200)
    model = make_tiny_model(vocab_size=len(load_tokenizer(tok)), hidden=64, layers=1, max_positions=32)
    with pytest.raises(ValueError, match=r"seq_len \(--seq-len\) 64 is past the 32 positions"):
        evaluate_loss(model, data, seq_len=64)  # was scored as if the model had seen such windows
    with pytest.raises(ValueError, match=r"max_windows \(--max-windows\) must be >= 1, got 0"):
        evaluate_loss(model, data, seq_len=16, max_windows=0)  # was a loss over no window, exit 0
    assert math.isfinite(evaluate_loss(model, data, seq_len=32, batch_size=2).loss)


def test_a_whole_token_file_still_loads_every_token(tmp_path):
    """The odd-size check refuses only a partial token: a good file loads as many tokens as meta.json says."""
    _, data = prepared_cpt(tmp_path, documents=20)
    meta = json.loads((data / "meta.json").read_text())
    assert len(load_tokens(data, "train")) == meta["train_tokens"]
