"""`infir2 eval` end to end on the shipped samples with a tiny saved model, and held-out perplexity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_tiny_model
from infir2.cli import main
from infir2.eval.command import sample_path
from infir2.eval.perplexity import evaluate_loss
from infir2.export import export_model

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    out = tmp_path_factory.mktemp("model") / "fp8"
    return export_model(make_tiny_model(), tiny_tokenizer, out, fmt="fp8", base_dtype=torch.float32)


@pytest.mark.parametrize(("task", "extra"), [("math", ["--n", "2"]), ("multiple_choice", ["--greedy"])])
def test_eval_cli_writes_a_well_formed_report(
    model_dir: Path, tmp_path: Path, task: str, extra: list[str], capsys
) -> None:
    out = tmp_path / "report"
    argv = [
        "eval",
        "--model",
        str(model_dir),
        "--task",
        task,
        "--max-new-tokens",
        "4",
        "--out",
        str(out),
        *extra,
    ]
    assert main(argv) == 0
    n = 2 if task == "math" else 1
    n_problems = sum(1 for line in sample_path(task).read_text().splitlines() if line.strip())
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["task"], summary["problems"], summary["samples_per_problem"]) == (task, n_problems, n)
    assert 0.0 <= summary["avg@n"] <= 1.0 and 0.0 <= summary[f"pass@{n}"] <= 1.0
    assert 0 <= summary["unparseable"] <= summary["samples"] == n * n_problems
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == n * n_problems
    assert set(samples[0]) == {
        "id",
        "sample",
        "gold",
        "extracted",
        "correct",
        "finished",
        "n_tokens",
        "completion",
    }
    assert all(s["n_tokens"] <= 4 for s in samples)
    problems = [json.loads(line) for line in (out / "problems.jsonl").read_text().splitlines()]
    assert [p["n_correct"] for p in problems] == [
        sum(s["correct"] for s in samples if s["id"] == p["id"]) for p in problems
    ]
    table = (out / "summary.md").read_text()
    assert "| unparseable |" in table and table in capsys.readouterr().out


def test_eval_cli_bad_data_is_one_line(model_dir: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "q", "answer": "1"}\n{"problem": "q"}\n')
    assert main(["eval", "--model", str(model_dir), "--data", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "bad.jsonl:2: missing key(s) ['answer']" in capsys.readouterr().err


def _write_tokens(folder: Path, ids: np.ndarray, dtype: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    ids.astype(dtype).tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps({"dtype": dtype}))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_perplexity_matches_transformers_loss(tmp_path: Path, dtype: str) -> None:
    model = make_tiny_model().eval()
    ids = np.random.default_rng(0).integers(0, 300, size=3 * 16 + 7)  # 3 full windows of 16 and a partial one
    _write_tokens(tmp_path / "tok", ids, dtype)
    got = evaluate_loss(model, tmp_path / "tok", seq_len=16, batch_size=3)
    # reference: transformers' own mean loss per window (labels = inputs, shifted inside), token-weighted
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, 16):
            window = torch.tensor(ids[start : start + 17]).long()[None]
            loss = model(input_ids=window, labels=window).loss
            total, count = total + float(loss) * (window.shape[1] - 1), count + window.shape[1] - 1
    assert got.tokens == count == len(ids) - 1
    assert got.loss == pytest.approx(total / count, rel=1e-5)
    assert got.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)


def test_perplexity_cli_and_errors(model_dir: Path, tmp_path: Path, capsys) -> None:
    _write_tokens(tmp_path / "tok", np.arange(100) % 300, "uint16")
    assert (
        main(
            [
                "eval",
                "--model",
                str(model_dir),
                "--perplexity",
                str(tmp_path / "tok"),
                "--seq-len",
                "32",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 0
    )
    loss = json.loads((tmp_path / "o" / "loss.json").read_text())
    assert loss["tokens"] == 99 and math.isclose(loss["perplexity"], math.exp(loss["loss"]))
    (tmp_path / "tok" / "meta.json").write_text('{"dtype": "int8"}')
    assert main(["eval", "--model", str(model_dir), "--perplexity", str(tmp_path / "tok")]) == 2
    assert "meta.json: key 'dtype' must be one of ['uint16', 'uint32']" in capsys.readouterr().err


def test_eval_cli_on_a_plain_save_pretrained_folder(tmp_path: Path, tiny_tokenizer) -> None:
    folder = tmp_path / "hf"
    make_tiny_model().to(torch.bfloat16).save_pretrained(folder)  # what the training loop writes
    tiny_tokenizer.save_pretrained(folder)
    out = tmp_path / "report"
    argv = [
        "eval",
        "--model",
        str(folder),
        "--greedy",
        "--limit",
        "2",
        "--max-new-tokens",
        "3",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["problems"] == 2 and summary["decoding"] == "greedy"


def test_eval_cli_resumes_with_the_local_engine(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    argv = ["eval", "--model", str(model_dir), "--greedy", "--max-new-tokens", "3", "--out", str(out)]
    assert main([*argv, "--limit", "3"]) == 0
    first = (out / "completions.jsonl").read_text().splitlines()
    assert main(argv) == 0  # the rest of the sample benchmark only
    lines = (out / "completions.jsonl").read_text().splitlines()
    summary = json.loads((out / "summary.json").read_text())
    assert lines[:3] == first and len(lines) == summary["samples"] == summary["problems"]
    assert summary["generated_now"] == summary["samples"] - 3
    # the same samples as one uninterrupted run
    assert main([*argv[:-1], str(tmp_path / "whole")]) == 0
    whole = [json.loads(line) for line in (tmp_path / "whole" / "samples.jsonl").read_text().splitlines()]
    assert whole == [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_the_completions_alone_refuse_other_settings(model_dir: Path, tmp_path: Path, capsys) -> None:
    """With eval_config.json deleted, a rerun at another temperature does not reuse the greedy samples:
    every record carries the digest of its settings."""
    out = tmp_path / "report"
    argv = ["eval", "--model", str(model_dir), "--max-new-tokens", "3", "--limit", "2", "--out", str(out)]
    assert main([*argv, "--greedy"]) == 0
    (out / "eval_config.json").unlink()
    assert main([*argv, "--temperature", "0.9"]) == 2
    err = capsys.readouterr().err
    assert "completions.jsonl:1: this sample was drawn with other settings" in err
    assert main([*argv, "--greedy"]) == 0  # the same settings resume, and the config is written again
    assert (out / "eval_config.json").is_file()
    assert json.loads((out / "summary.json").read_text())["generated_now"] == 0
