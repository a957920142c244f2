"""Bad inputs of issue 46 (the third round), each refused in one line (exit 2) that names the flag, key or
file, before any weights are read and with nothing written: an --out folder that cannot be written, a
rerun into a folder of other settings (with or without its eval_config.json), a --max-new-tokens past
the model's positions, the flags of another kind of engine, FP8 asked of an engine that cannot run it,
an RL engine that returns text only."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import infir2.export
from conftest import make_tiny_model, make_tokenizer
from infir2.cli import main
from infir2.eval.completions import CONFIG_FILE
from infir2.rl import parse_rl_config
from train_synthetic import one_thread, subprocess_env

_one_thread = pytest.fixture(autouse=True)(one_thread)


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "model"
    make_tiny_model(hidden=64, layers=1, seed=1).save_pretrained(folder)  # vocabulary 300, 512 positions
    make_tokenizer().save_pretrained(folder)
    return folder


def _refused(capsys, argv: list[str], *needles: str) -> str:
    """``infir2 argv`` exits 2 with one stderr line (log records aside) holding every needle."""
    capsys.readouterr()  # what came before (a fixture's progress bars)
    rc = main(argv)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and " WARNING " not in ln]
    assert rc == 2 and len(lines) == 1 and all(n in lines[0] for n in needles), (rc, lines)
    return lines[0]


@pytest.fixture
def no_weights(monkeypatch):
    """Reading a model's weights fails the test: a refusal must come before."""

    def load_checkpoint(*args, **kwargs):
        raise AssertionError("weights were read before the refusal")

    monkeypatch.setattr(infir2.export, "load_checkpoint", load_checkpoint)


def _eval(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "eval",
        "--model",
        str(model_dir),
        "--limit",
        "1",
        "--max-new-tokens",
        "3",
        "--out",
        str(out),
        *extra,
    ]


def test_a_rerun_with_other_settings_is_refused_before_any_weights(model_dir, tmp_path, capsys, request):
    out, data = tmp_path / "out", tmp_path / "p.jsonl"
    data.write_text(json.dumps({"id": "q", "problem": "1 + 1", "answer": "2"}) + "\n")
    assert main(_eval(model_dir, out, "--greedy", "--data", str(data))) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    request.getfixturevalue("no_weights")  # from here on, reading weights fails the test
    other = _eval(model_dir, out, "--temperature", "0.9", "--data", str(data))
    _refused(capsys, other, "other settings", "temperature: None -> 0.9")
    data.write_text(json.dumps({"id": "q", "problem": "2 + 2", "answer": "4"}) + "\n")  # edited data
    _refused(capsys, _eval(model_dir, out, "--greedy", "--data", str(data)), "prompts of problem(s) ['q']")
    (out / CONFIG_FILE).unlink()  # the records' settings digests decide alone
    _refused(capsys, other, "completions.jsonl:1", "other settings")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {
        k: v for k, v in before.items() if k != CONFIG_FILE
    }


def test_a_deleted_eval_config_is_written_again_and_said(model_dir, tmp_path, caplog):
    out = tmp_path / "out"
    assert main(_eval(model_dir, out, "--greedy")) == 0
    saved = (out / CONFIG_FILE).read_text()
    (out / CONFIG_FILE).unlink()
    with caplog.at_level("WARNING"):
        assert main(_eval(model_dir, out, "--greedy")) == 0
    said = [r.getMessage() for r in caplog.records if CONFIG_FILE in r.getMessage()]
    assert len(said) == 1 and "was missing: written again" in said[0] and "1 samples" in said[0], said
    assert (out / CONFIG_FILE).read_text() == saved


def test_a_budget_past_the_positions_is_refused_before_any_weights(model_dir, tmp_path, capsys, no_weights):
    argv = _eval(model_dir, tmp_path / "out", "--greedy")
    argv[argv.index("--max-new-tokens") + 1] = str(10**12)
    _refused(capsys, argv, "--max-new-tokens 1000000000000", "512 positions", "config.json")
    big = tmp_path / "big-tokenizer"
    make_tokenizer(vocab_size=600).save_pretrained(big)
    _refused(capsys, _eval(model_dir, tmp_path / "out", "--tokenizer", str(big)), "embedding only 300 rows")
    assert not (tmp_path / "out").exists()


#: as root (whom chmod does not bind) the command runs as ``nobody`` through util-linux's setpriv
AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []


def _as_nobody(argv: list[str], home: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*AS_NOBODY, sys.executable, "-m", "infir2.cli", *argv],
        env={**subprocess_env(tests_too=False), "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(bool(AS_NOBODY) and not shutil.which("setpriv"), reason="root without setpriv")
def test_a_read_only_out_folder_is_one_line_before_any_weights(model_dir):
    """A read-only --out (a real one: as root, the command runs as ``nobody``, whom chmod binds) is said
    in one line naming it, and nothing is written into it (it was a PermissionError traceback)."""
    if AS_NOBODY:  # nobody must be able to read the install (a clone under a 0700 folder is not)
        probe = subprocess.run([*AS_NOBODY, sys.executable, "-c", "import infir2.cli"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip("nobody cannot import infir2 from this checkout (a folder above it is not readable)")
    top = Path(tempfile.mkdtemp(prefix="infir2-ro-"))
    try:
        os.chmod(top, 0o755)
        model = shutil.copytree(model_dir, top / "model")
        for p in [model, *model.iterdir()]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        (top / "ro").mkdir(mode=0o555)
        os.chmod(top / "ro", 0o555)
        for out in ("ro", "ro/a/b"):
            proc = _as_nobody(_eval(model, top / out, "--greedy"), top)
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and " WARNING " not in ln]
            assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
            assert f"--out {top / out}: {top / 'ro'} is not writable" in lines[0]
            assert "Loading weights" not in proc.stderr
        assert list((top / "ro").iterdir()) == []
    finally:
        shutil.rmtree(top)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--concurrency", "2"], "--concurrency is a flag of --engine server, not of --engine builtin"),
        (["--base-url", "http://127.0.0.1:1"], "--base-url is a flag of --engine server"),
        (["--extra-body", "{}"], "--extra-body is a flag of --engine server"),
        (["--scale-encoding", "fp32"], "--scale-encoding sets the block scales of --precision fp8"),
        (
            ["--precision", "recipe", "--recipe", "blockwise", "--scale-encoding", "fp32"],
            "--scale-encoding sets the block scales",
        ),
        (["--precision", "recipe"], "--precision recipe needs --recipe NAME"),
        (
            ["--recipe", "blockwise"],
            "--recipe names the training recipe of --precision recipe, not of --precision high",
        ),
        (
            ["--precision", "fp8", "--recipe", "blockwise"],
            "--recipe names the training recipe of --precision",
        ),
    ],
)
def test_a_flag_of_another_engine_is_refused(model_dir, tmp_path, capsys, no_weights, extra, needle):
    _refused(capsys, _eval(model_dir, tmp_path / "out", *extra), needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--batch-size", "4"], "--batch-size is a flag of an in-process engine (--engine builtin)"),
        (["--device", "cpu"], "--device is a flag of an in-process engine"),
        (["--beyond-context"], "--beyond-context is a flag of an in-process engine"),
        (["--precision", "fp8"], "--precision: the server engine cannot run FP8 (the FP8 export's weights)"),
        (
            ["--precision", "recipe", "--recipe", "blockwise"],
            "--precision: the server engine cannot run a training recipe's FP8",
        ),
        (["--recipe", "blockwise"], "--recipe is a flag of an in-process engine"),
    ],
)
def test_the_server_engine_refuses_local_flags_and_fp8(model_dir, tmp_path, capsys, extra, needle):
    server = ["--engine", "server", "--base-url", "http://127.0.0.1:1", "--tokenizer", str(model_dir)]
    _refused(capsys, _eval(model_dir, tmp_path / "out", *server, *extra), needle)
    assert not (tmp_path / "out").exists()


def test_an_unknown_engine_is_one_line(model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse's own refusal of a name not in the registry
        main(_eval(model_dir, tmp_path / "out", "--engine", "vllm9"))
    rc = exit_.value.code
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith(("usage:", " "))]
    assert rc == 2 and len(err) == 1 and "--engine: invalid choice: 'vllm9'" in err[0], err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_vllm_engine_without_vllm_is_one_line_saying_how_to_install_it(model_dir, tmp_path, capsys):
    _refused(
        capsys,
        _eval(model_dir, tmp_path / "out", "--engine", "vllm"),
        "--engine vllm: engine 'vllm' needs vLLM: pip install",
    )
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"rl\.yaml: rollout\.engine: engine 'vllm' needs vLLM: pip install"):
        parse_rl_config(
            {"data": {"prompts_path": "p.jsonl"}, "rollout": {"engine": "vllm", "precision": "high"}},
            "rl.yaml",
        )
    with pytest.raises(ValueError, match=r"vllm\.max_model_len.*rollout\.engine is 'builtin'"):
        parse_rl_config({"data": {"prompts_path": "p.jsonl"}, "vllm": {"max_model_len": 64}}, "rl.yaml")


def test_rl_refuses_a_text_only_engine_and_fp8_it_cannot_run(tmp_path, monkeypatch):
    from dataclasses import replace

    from infir2.generation import ENGINES, EngineTraits

    cfg = {
        "run": {"name": "r", "out_dir": str(tmp_path)},
        "model": {"path": str(tmp_path)},
        "data": {"prompts_path": str(tmp_path / "p.jsonl")},
        "rollout": {"engine": "server"},
    }
    with pytest.raises(ValueError, match=r"^x.yaml: rollout.engine: the server engine returns text only"):
        parse_rl_config(cfg, "x.yaml")
    high_only = replace(ENGINES["builtin"], traits=EngineTraits(True, ("high",), True))
    monkeypatch.setitem(ENGINES, "high-only", high_only)  # an engine that runs no FP8
    cfg["rollout"] = {"engine": "high-only", "precision": "fp8"}
    with pytest.raises(
        ValueError, match=r"^x.yaml: rollout.precision: the high-only engine cannot run FP8 \(the FP8 export"
    ):
        parse_rl_config(cfg, "x.yaml")
    cfg["rollout"] = {"engine": "high-only", "precision": "high"}
    assert parse_rl_config(cfg, "x.yaml").rollout.engine == "high-only"  # what it can run is accepted


def test_an_fp8_run_of_experts_the_conversion_does_not_run_is_refused(tmp_path, capsys, caplog):
    """Llama-4's experts (another 3-D layout): an FP8 train run is refused before any weights are read
    (the experts would train in high precision under an FP8 recipe's name); the module it names is the one
    ``convert_to_fp8`` leaves high precision on the loaded model; a supported MoE passes the check."""
    from infir2 import convert_to_fp8
    from infir2.model import check_experts
    from moe_models import make_tiny_moe, make_unrecognised_moe

    folder = tmp_path / "llama4"
    make_unrecognised_moe(vocab_size=300).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    cfg = {
        "run": {"name": "moe", "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "model": {"path": str(folder), "precision": "fp32"},
        "fp8": {"recipe": "blockwise"},
        "data": {"train_path": str(tmp_path / "cpt"), "seq_len": 16, "global_batch_size": 2},
        "train": {"max_steps": 1},
    }
    path = tmp_path / "moe.yaml"
    path.write_text(json.dumps(cfg))
    line = _refused(capsys, ["train", str(path), "--no-progress"], "fp8.recipe: blockwise", str(folder))
    assert "model.layers.0.feed_forward.experts: Llama4TextExperts" in line and "fp8.recipe: bf16" in line
    assert not (tmp_path / "runs").exists()
    from transformers import AutoModelForCausalLM

    with caplog.at_level("WARNING"):
        convert_to_fp8(AutoModelForCausalLM.from_pretrained(folder))
    assert "MoE experts not recognised: Llama4TextExperts" in caplog.text
    assert "model.layers.0.feed_forward.experts" in caplog.text
    supported = tmp_path / "qwen3-moe"
    make_tiny_moe("qwen3_moe").save_pretrained(supported)
    check_experts(supported, "blockwise")  # experts Fp8Experts runs: no refusal


def test_under_torchrun_an_error_every_rank_makes_is_written_once():
    """``_dist.report_once`` over a real store (as torchrun's launcher holds one): rank 0 writes its line;
    another rank with the same line writes nothing, one with another cause writes it tagged, and one
    whose rank 0 never failed writes it after the wait; without a store every rank writes, tagged."""
    from datetime import timedelta

    import torch.distributed as dist

    from infir2._dist import LaunchStore, report_once

    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    store = LaunchStore("127.0.0.1", master.port, "run/0")
    written: list[str] = []
    report_once("e: same", 0, store, written.append, wait_s=0.5)
    report_once("e: same", 1, store, written.append, wait_s=0.5)
    report_once("e: rank 2 alone", 2, store, written.append, wait_s=0.5)
    assert written == ["e: same", "[rank 2] e: rank 2 alone"]
    report_once("e: x", 1, LaunchStore("127.0.0.1", master.port, "other/0"), written.append, wait_s=0.2)
    report_once("e: y", 3, None, written.append)
    assert written[2:] == ["[rank 1] e: x", "[rank 3] e: y"]


@pytest.mark.slow
def test_a_context_degree_that_does_not_divide_the_world_is_one_line_under_torchrun(tmp_path):
    """``parallel.context: 3`` on 2 processes: one infir2 line (rank 0's), not one per rank; what follows is
    torchrun's own tail (its ChildFailedError traceback and summary, printed by the launcher)."""
    from train_synthetic import prepared_cpt, tiny_llama

    tok, data = prepared_cpt(tmp_path, documents=50)
    cfg = {
        "run": {"name": "cp", "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "model": {"from_config": tiny_llama(layers=1, max_positions=512), "tokenizer": str(tok)},
        "fp8": {"recipe": "bf16"},
        "parallel": {"context": 3},
        "data": {"train_path": str(data), "seq_len": 384, "global_batch_size": 2},
        "train": {"max_steps": 1},
    }
    path = tmp_path / "cp.yaml"
    path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, "-m", "infir2.cli", "train", str(path), "--no-progress"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    ours = [ln for ln in proc.stderr.splitlines() if "infir2 train: error:" in ln]
    assert proc.returncode != 0 and ours == [
        "infir2 train: error: parallel.context: 3 does not divide the 2 processes (the world is data x context)"
    ], proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr and not (tmp_path / "runs").exists()


def test_held_out_windows_and_a_big_tokenizer_are_refused_before_any_weights(
    model_dir, tmp_path, capsys, monkeypatch, no_weights
):
    """eval --perplexity's windows (eval reads no weights: ``no_weights``), and the tokenizer of a train
    run against config.json's vocabulary (``load_pretrained`` may not be called)."""
    import infir2.harness.setup as setup
    from train_synthetic import prepared_cpt

    _, data = prepared_cpt(tmp_path, documents=50)
    ppl = ["eval", "--model", str(model_dir), "--perplexity", str(data), "--out", str(tmp_path / "o")]
    _refused(capsys, [*ppl, "--seq-len", "100000"], "--seq-len", "512 positions")
    _refused(capsys, [*ppl, "--split", "nope", "--seq-len", "16"], "nope.bin")
    (tmp_path / "a-file").write_text("x")
    _refused(capsys, [*ppl, "--seq-len", "16", "--out", str(tmp_path / "a-file" / "x")], "--out", "a-file")

    def load_pretrained(path):
        raise AssertionError("weights were read before the refusal")

    monkeypatch.setattr(setup, "load_pretrained", load_pretrained)
    big = tmp_path / "big-tokenizer"
    make_tokenizer(vocab_size=600).save_pretrained(big)
    cfg = {
        "run": {"name": "r", "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "model": {"path": str(model_dir), "tokenizer": str(big), "precision": "fp32"},
        "fp8": {"recipe": "bf16"},
        "data": {"train_path": str(data), "seq_len": 16, "global_batch_size": 2},
        "train": {"max_steps": 1},
    }
    path = tmp_path / "big.yaml"
    path.write_text(json.dumps(cfg))
    _refused(capsys, ["train", str(path), "--no-progress"], "big-tokenizer", "embedding only 300 rows")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "o").exists()
