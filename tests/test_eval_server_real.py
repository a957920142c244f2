"""`infir2 eval --engine server` against a real `transformers serve` on tiny exported models (BF16 and FP8).

* greedy results through the server equal the builtin engine's, sample by sample, on the same folder;
* a server killed mid-evaluation makes the command stop with a one-line error, keeping what was
  finished; after a restart, the same command generates only the rest: every sample answered once.

The tiny model has projection sizes that are multiples of 128 (transformers' FP8 dequantizer derives
the block size from the scale grid), and its tokenizer is re-saved as `AutoTokenizer` loads it:
`transformers serve` tokenizes the prompt with `AutoTokenizer`, which in transformers 5 rebuilds a
generic tokenizer saved in a Qwen2 folder as `Qwen2Tokenizer` (another pre-tokenizer).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model
from infir2.cli import main
from infir2.eval.completions import COMPLETIONS_FILE
from infir2.export import export_model
from transformers_server import needs_serving, transformers_serve

pytestmark = [pytest.mark.slow, needs_serving, pytest.mark.timeout(600)]

FORMATS = ["bf16", "fp8"]
VOLATILE = {"engine", "precision", "seconds", "new_tokens_per_second"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_tokenizer) -> dict[str, Path]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("served")
    model = make_tiny_model(hidden=256)  # q/k/v/o, gate/up/down: 256, 128, 640 -- whole 128-blocks
    out = {}
    for fmt in FORMATS:
        folder = export_model(model, tiny_tokenizer, root / fmt, fmt=fmt, base_dtype=torch.bfloat16)
        AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
        out[fmt] = folder
    return out


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("fmt", FORMATS)
def test_server_greedy_equals_builtin(folders: dict[str, Path], tmp_path: Path, fmt: str, capsys) -> None:
    folder = folders[fmt]
    common = ["--model", str(folder), "--greedy", "--max-new-tokens", "24"]
    assert main(["eval", *common, "--out", str(tmp_path / "builtin")]) == 0
    with transformers_serve(folder, tmp_path / "serve.log") as server:
        served = ["eval", *common, "--engine", "server", "--base-url", server.url]
        assert main([*served, "--concurrency", "2", "--out", str(tmp_path / "server")]) == 0
        # the real server's model list: another name is refused before any request, in one line
        other = ["--model", "other", "--tokenizer", str(folder), "--out", str(tmp_path / "other")]
        assert main([*served, *other]) == 1
        assert f"serves '{folder}', not 'other'" in capsys.readouterr().err
    builtin, served = (_read(tmp_path / d / "samples.jsonl") for d in ("builtin", "server"))
    assert len(builtin) == 8 and served == builtin  # text, token count, finished, extracted answer, verdict
    assert _read(tmp_path / "server" / "problems.jsonl") == _read(tmp_path / "builtin" / "problems.jsonl")
    summaries = [json.loads((tmp_path / d / "summary.json").read_text()) for d in ("builtin", "server")]
    # the dtype an in-process engine served in; a server's is its own (not known to the client)
    assert summaries[0].pop("dtype") == "float32" and "dtype" not in summaries[1]
    assert [{k: v for k, v in s.items() if k not in VOLATILE} for s in summaries] == [
        {k: v for k, v in summaries[0].items() if k not in VOLATILE}
    ] * 2
    print(
        f"{fmt}: builtin {summaries[0]['new_tokens_per_second']} tok/s, "
        f"server {summaries[1]['new_tokens_per_second']} tok/s"
    )


def test_server_killed_mid_evaluation_then_rerun(folders: dict[str, Path], tmp_path: Path) -> None:
    folder, out = folders["fp8"], tmp_path / "out"
    log = tmp_path / "serve.log"
    with transformers_serve(folder, log) as server:
        argv = [
            "eval",
            "--engine",
            "server",
            "--base-url",
            server.url,
            "--model",
            str(folder),
            "--n",
            "4",
            "--max-new-tokens",
            "48",
            "--concurrency",
            "2",
            "--retries",
            "2",
            "--out",
            str(out),
        ]
        client = subprocess.Popen(
            [sys.executable, "-m", "infir2.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 300
        while not (out / COMPLETIONS_FILE).is_file() or len(_read(out / COMPLETIONS_FILE)) < 4:
            assert client.poll() is None and time.monotonic() < deadline, client.communicate()
            time.sleep(0.05)
        server.kill()
        _, err = client.communicate(timeout=120)
    assert client.returncode == 1, err
    errors = [line for line in err.splitlines() if line.startswith("infir2 eval: error:")]
    assert len(errors) == 1 and "cannot reach" in errors[0] and "after 3 tries" in errors[0], err
    before = _read(out / COMPLETIONS_FILE)
    assert 4 <= len(before) < 32
    with transformers_serve(folder, log, port=server.port) as server:
        assert main(argv) == 0
    after = _read(out / COMPLETIONS_FILE)
    assert after[: len(before)] == before  # nothing rewritten
    assert sorted((r["id"], r["sample"]) for r in after) == sorted(
        {(r["id"], s) for r in after for s in range(4)}
    )
    assert len(after) == 32  # 8 problems x 4 samples, each once
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["samples"], summary["generated_now"]) == (32, 32 - len(before))
