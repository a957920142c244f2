"""Every bad input of issue 10 through the command line: exit code 2, one line naming the file (and the
line or key), no traceback, nothing half-written. In-process (``infir2.cli.main`` returns the exit
code; its ``except`` is what turns an error into one line) plus one real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import cli_fails, make_tiny_model, make_tokenizer
from infir2.cli import main
from infir2.data import load_tokenizer, prepare_cpt
from train_synthetic import one_thread, tiny_llama

_one_thread = pytest.fixture(autouse=True)(one_thread)

SRC = Path(__file__).resolve().parents[1] / "src"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tokenizer, a good CPT dataset and a base config (tiny llama from_config, fp32 on CPU)."""
    root = tmp_path_factory.mktemp("bad")
    make_tokenizer().save_pretrained(root / "tok")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"{i} + {i} = {2 * i}."}) + "\n" for i in range(200)))
    prepare_cpt([docs], root / "cpt", load_tokenizer(root / "tok"), val_fraction=0.1, progress=False)
    cfg = {
        "run": {"name": "r", "out_dir": str(root / "runs"), "device": "cpu"},
        "model": {
            "from_config": tiny_llama(layers=1, max_positions=64),
            "tokenizer": str(root / "tok"),
            "precision": "fp32",
        },
        "data": {"kind": "cpt", "train_path": str(root / "cpt"), "seq_len": 16, "global_batch_size": 2},
        "optim": {"lr": 1e-3},
        "schedule": {"name": "constant"},
        "train": {"max_steps": 2},
    }
    (root / "run.yaml").write_text(yaml.safe_dump(cfg))
    return root


def _train(world: Path, *sets: str) -> list[str]:
    return ["train", str(world / "run.yaml"), "--no-progress", *(x for s in sets for x in ("--set", s))]


def test_prepare_cpt_bad_input(world, capsys):
    good = _snapshot(world / "cpt")
    bad = world / "latin1.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    argv = [
        "prepare-cpt",
        str(bad),
        "--tokenizer",
        str(world / "tok"),
        "--out",
        str(world / "cpt"),
        "--no-progress",
    ]
    cli_fails(capsys, argv, f"{bad}:2", "UTF-8")
    broken = world / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{"text": oops\n')
    cli_fails(capsys, [*argv[:1], str(broken), *argv[2:]], f"{broken}:2", "invalid JSON")
    assert _snapshot(world / "cpt") == good  # the good dataset is untouched
    assert not [p for p in world.iterdir() if p.name.startswith(".")]  # no temporary folder left
    cli_fails(capsys, [*argv[:3], str(world / "no-tok"), *argv[4:]], "tokenizer folder not found", "no-tok")


def test_train_bad_inputs_leave_no_run_folder(world, tmp_path, capsys):
    runs = world / "runs"
    cli_fails(capsys, _train(world, "optim.lr=1e39"), "optim.lr", "overflows float32", "run.yaml")
    cli_fails(capsys, _train(world, "optim.lr=nan"), "optim.lr", "finite")
    missing = tmp_path / "no-model"
    cli_fails(
        capsys,
        _train(world, "model.from_config=null", f"model.path={missing}"),
        f"model folder {missing} does not exist",
    )
    no_weights = tmp_path / "no-weights"
    make_tiny_model().config.save_pretrained(no_weights)
    cli_fails(
        capsys,
        _train(world, "model.from_config=null", f"model.path={no_weights}"),
        f"model folder {no_weights}",
        "no weights",
    )
    sft = tmp_path / "chat.jsonl"
    sft.write_bytes(b'{"messages": [{"role": "user", "content": "h\xffi"}]}\n')
    cli_fails(
        capsys,
        _train(
            world,
            "data.kind=sft",
            f"data.train_path={sft}",
            "data.max_tokens_per_micro_batch=64",
            "data.max_length=64",
        ),
        f"{sft}:1",
        "UTF-8",
    )
    cli_fails(capsys, _train(world, f"data.train_path={tmp_path / 'no-data'}"), "no-data")
    assert not runs.exists() or not any(runs.iterdir())  # no run folder left behind by a failed start


def test_train_divergence_and_changed_config(world, capsys):
    runs = world / "runs"
    # lr 1e30 fits fp32 but no AdamW run uses a learning rate above 1: refused with the config
    cli_fails(capsys, _train(world, "run.name=refused", "optim.lr=1e30"), "optim.lr: 1e+30 is above 1")
    assert not (runs / "refused").exists()
    # lr 1 (accepted) diverges within a few steps: non-finite losses or loss spikes, a streak stops it
    line = cli_fails(
        capsys,
        _train(
            world,
            "run.name=diverge",
            "optim.lr=1",
            "train.max_steps=8",
            "train.save_every=1",
            "train.keep_last=1",
            "train.max_skipped_in_row=2",
        ),
        "steps in a row had a non-finite loss",
    )
    kept = sorted(p.name for p in (runs / "diverge" / "checkpoints").glob("step_*"))
    assert (
        len(kept) == 1 and str(runs / "diverge" / "checkpoints" / kept[0]) in line
    )  # the one before the streak

    assert main(_train(world, "run.name=changed")) == 0
    saved = (runs / "changed" / "config.yaml").read_bytes()
    capsys.readouterr()
    cli_fails(
        capsys,
        _train(world, "run.name=changed", "train.max_steps=4"),
        "train.max_steps: 2 -> 4",
        str(runs / "changed" / "config.yaml"),
        "--accept-config-changes",
    )
    assert (runs / "changed" / "config.yaml").read_bytes() == saved


def test_export_bad_inputs(world, tmp_path, capsys):
    no_weights = tmp_path / "no-weights"
    make_tiny_model().config.save_pretrained(no_weights)
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    cli_fails(capsys, ["export", "--model", str(no_weights), "--out", str(tmp_path / "o")], str(no_weights))
    cli_fails(
        capsys,
        ["export", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
        f"model folder {tmp_path / 'nope'} does not exist",
    )
    hf = tmp_path / "hf"
    make_tiny_model().save_pretrained(hf)
    capsys.readouterr()
    cli_fails(capsys, ["export", "--model", str(hf), "--out", str(out)], f"output folder {out} is not empty")
    assert _snapshot(out) == {"notes.txt": b"mine"}
    cli_fails(
        capsys,
        ["eval", "--model", str(tmp_path / "nope")],
        f"model folder {tmp_path / 'nope'} does not exist",
    )


@pytest.mark.slow  # ~10 s: a fresh interpreter imports torch and transformers
def test_a_real_process_prints_one_line_and_exit_code_2(world, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"line one\nline \xff two\n")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "infir2.cli",
            "prepare-cpt",
            str(bad),
            "--tokenizer",
            str(world / "tok"),
            "--out",
            str(tmp_path / "out"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and f"{bad}:2: not valid UTF-8" in errors[0]
    assert not (tmp_path / "out").exists()
