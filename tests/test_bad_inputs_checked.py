"""Bad inputs the stages now refuse in one line (exit 2) before a run starts, where they used to end in a
traceback or run on silently wrong (issue 28's probe): a device the machine lacks or that does not
exist, a negative ``--limit``, a tokenizer larger than the model's embedding, sequences past the model's
trained positions, and an RL round that could never fill a step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import make_tiny_model, make_tokenizer
from infir2.cli import main
from infir2.data import load_tokenizer
from infir2.rl import parse_rl_config
from train_synthetic import one_thread, prepared_cpt, tiny_llama, tiny_rl_sections

_one_thread = pytest.fixture(autouse=True)(one_thread)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "model"
    make_tiny_model(seed=1).save_pretrained(folder)  # vocabulary 300, 512 positions
    make_tokenizer().save_pretrained(folder)
    return folder


def _one_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(n in err for n in needles), err
    return err


@pytest.mark.parametrize(
    ("device", "needle"),
    [("tpu9", "'tpu9' is not a device"), pytest.param("cuda", "no CUDA device", marks=no_cuda)],
)
def test_eval_refuses_a_device_it_cannot_use(model_dir, tmp_path, capsys, device, needle):
    out = tmp_path / "out"
    assert main(["eval", "--model", str(model_dir), "--device", device, "--out", str(out)]) == 2
    _one_line(capsys, "--device", needle)
    assert not out.exists()


@no_cuda
def test_train_refuses_cuda_on_a_machine_without_it(tmp_path, capsys):
    cfg = tmp_path / "t.yaml"
    cfg.write_text(yaml.safe_dump({"run": {"device": "cuda", "out_dir": str(tmp_path / "runs")}}))
    assert main(["train", str(cfg)]) == 2
    _one_line(capsys, "run.device", "no CUDA device")


@pytest.mark.parametrize("flag", ["--limit", "--n"])
def test_eval_refuses_a_count_below_one_and_writes_nothing(model_dir, tmp_path, capsys, flag):
    out = tmp_path / "out"
    assert main(["eval", "--model", str(model_dir), flag, "-1", "--out", str(out)]) == 2
    _one_line(capsys, f"{flag} must be >= 1, got -1")
    assert not out.exists()  # before: --limit -1 scored 3 of 4 problems (problems[:-1]) as a normal run


def _rl_yaml(tmp_path, model_dir, **sections) -> str:
    data = tiny_rl_sections(tmp_path, model_dir)
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_tokenizer_larger_than_the_embedding_is_refused(model_dir, tmp_path, capsys):
    big = tmp_path / "big-tokenizer"
    make_tokenizer(vocab_size=600).save_pretrained(big)
    assert len(load_tokenizer(big)) > 300
    assert main(["rl", _rl_yaml(tmp_path, model_dir, model={"tokenizer": str(big)}), "--no-progress"]) == 2
    _one_line(capsys, str(big), "tokens but the model's embedding only 300 rows")
    assert not (tmp_path / "runs" / "rl" / "metrics.jsonl").exists()


def test_rl_refuses_responses_past_the_models_positions(model_dir, tmp_path, capsys):
    cfg = _rl_yaml(tmp_path, model_dir, rollout={"max_new_tokens": 10**12})
    assert main(["rl", cfg, "--no-progress"]) == 2
    _one_line(capsys, "rollout.max_new_tokens", "trained for 512 positions", "model.beyond_context")


def test_an_rl_round_that_cannot_fill_a_step_is_refused():
    rollout = {"prompts_per_step": 4, "oversample_prompts": 3}
    with pytest.raises(
        ValueError, match=r"rollout.oversample_prompts: 3 is below rollout.prompts_per_step=4"
    ):
        parse_rl_config({"rollout": rollout}, "rl.yaml")


def _short_model_run(tmp_path, name: str, tok_dir, positions: int, data: dict) -> dict:
    """A one-step fp32 run of a 1-layer tiny Llama trained for ``positions`` positions."""
    return {
        "run": {"name": name, "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "model": {"from_config": tiny_llama(1, positions), "tokenizer": str(tok_dir), "precision": "fp32"},
        "fp8": {"recipe": "bf16"},
        "data": data,
        "train": {"max_steps": 1},
    }


def test_train_refuses_windows_past_the_models_positions_unless_asked(tmp_path, capsys):
    tok_dir, _ = prepared_cpt(tmp_path, documents=200)
    data = {"train_path": str(tmp_path / "cpt"), "seq_len": 32, "global_batch_size": 2}
    cfg = _short_model_run(tmp_path, "long", tok_dir, 16, data)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--no-progress"]) == 2
    _one_line(capsys, "data.seq_len: 32 tokens per sequence", "trained for 16 positions")
    assert not (tmp_path / "runs" / "long").exists()
    assert main(["train", str(path), "--no-progress", "--set", "model.beyond_context=true"]) == 0


def test_an_output_folder_that_is_a_file_is_one_line(model_dir, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main(["eval", "--model", str(model_dir), "--limit", "1", "--out", str(blocker / "x")]) == 2
    _one_line(capsys, "--out", "is a file")
    cfg = _rl_yaml(tmp_path, model_dir, run={"out_dir": str(blocker)})
    assert main(["rl", cfg, "--no-progress"]) == 2
    _one_line(capsys, "run.out_dir / run.name", "is a file")


def test_a_run_name_cannot_leave_the_out_dir():
    with pytest.raises(ValueError, match=r"run.name: must name a folder inside run.out_dir"):
        parse_rl_config({"run": {"name": "../../escape"}}, "rl.yaml")


@pytest.mark.parametrize("damage", ["truncated", "garbage header"])
def test_a_damaged_weight_file_is_named_in_one_line(model_dir, tmp_path, capsys, damage):
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\xff" * 64 + data[64:])
    for argv in (
        ["eval", "--model", str(model_dir), "--limit", "1", "--out", str(tmp_path / "e")],
        ["export", "--model", str(model_dir), "--out", str(tmp_path / "x")],
        ["rl", _rl_yaml(tmp_path, model_dir), "--no-progress"],
    ):
        assert main(argv) == 2, argv
        _one_line(capsys, f"{weights} is damaged")


def test_eval_refuses_a_prompt_past_the_context_and_cuts_samples_at_it(tmp_path, capsys, caplog):
    """A model of 160 positions: a long problem is refused in one line (unless --beyond-context); a short
    problem whose prompt + budget pass the positions stops at them, unfinished (counted as truncated); a
    budget the positions can never hold is refused when asked for (nothing written), and said in one
    warning line when it is the default's (32768)."""
    folder = tmp_path / "short-model"
    make_tiny_model(seed=1, max_positions=160).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"problem": "Compute 1 + 1.", "answer": "2"}) + "\n")
    argv = ["eval", "--model", str(folder), "--data", str(data), "--greedy"]
    assert main([*argv, "--max-new-tokens", "150", "--out", str(tmp_path / "a")]) == 0
    record = json.loads((tmp_path / "a" / "completions.jsonl").read_text().splitlines()[0])
    assert not record["finished"] and 0 < record["n_tokens"] < 150  # stopped at the positions, not at 150
    capsys.readouterr()
    assert main([*argv, "--max-new-tokens", "500", "--out", str(tmp_path / "c")]) == 2
    _one_line(capsys, "--max-new-tokens 500 is more than the model's 160 positions", "config.json")
    assert not (tmp_path / "c").exists()
    with caplog.at_level("WARNING"):
        assert main([*argv, "--out", str(tmp_path / "d")]) == 0
    said = [r.getMessage() for r in caplog.records if "positions:" in r.getMessage()]
    assert said == [
        "--max-new-tokens 32768 (the default) is more than the model's 160 positions: each sample stops where "
        "prompt and response reach 160 tokens (--beyond-context runs past them)"
    ]
    assert json.loads((tmp_path / "d" / "completions.jsonl").read_text())["n_tokens"] == record["n_tokens"]
    long = tmp_path / "long.jsonl"
    long.write_text(
        json.dumps({"problem": "Compute " + " + ".join(["1"] * 200) + ".", "answer": "200"}) + "\n"
    )
    capsys.readouterr()
    assert main(["eval", "--model", str(folder), "--data", str(long), "--out", str(tmp_path / "b")]) == 2
    _one_line(capsys, "does not fit the model's 160 positions", "--beyond-context")


def test_eval_refuses_a_tokenizer_larger_than_the_embedding(model_dir, tmp_path, capsys):
    big = tmp_path / "big-tokenizer"
    make_tokenizer(vocab_size=600).save_pretrained(big)
    argv = ["eval", "--model", str(model_dir), "--tokenizer", str(big), "--limit", "1"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    _one_line(capsys, "tokens but the model's embedding only 300 rows")


def test_an_export_out_that_is_a_file_or_under_one_is_one_line(model_dir, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    for out in (blocker, blocker / "x"):
        assert main(["export", "--model", str(model_dir), "--out", str(out)]) == 2
        _one_line(capsys, "--out", "is a file")


def test_an_fp8_export_transformers_cannot_load_is_said_with_the_way_out(tmp_path, caplog):
    """Width 320 gives MLP weights of (640, 320) and (320, 640): partial 128-blocks, which transformers'
    FP8 loader refuses. The export names them; --whole-blocks-only keeps them in bf16 and says so in
    modules_to_not_convert, and that folder loads in transformers."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "w320"
    make_tiny_model(hidden=320, intermediate=640, heads=5, kv_heads=1, layers=1).save_pretrained(folder)
    with caplog.at_level("WARNING"):
        assert main(["export", "--model", str(folder), "--out", str(tmp_path / "a")]) == 0
    assert "not whole 128x128 blocks" in caplog.text and "mlp.down_proj.weight" in caplog.text
    with pytest.raises(Exception):  # noqa: B017 - transformers' own error, whatever its type
        AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)  # why the warning exists
    assert main(["export", "--model", str(folder), "--out", str(tmp_path / "b"), "--whole-blocks-only"]) == 0
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert "model.layers.0.mlp.down_proj" in config["quantization_config"]["modules_to_not_convert"]
    AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32)  # loads


def test_train_refuses_an_sft_sample_past_the_models_positions(tmp_path, capsys):
    tok_dir, _ = prepared_cpt(tmp_path, documents=10)
    chats = tmp_path / "chats.jsonl"
    long = {"messages": [{"role": "user", "content": "add " * 40}, {"role": "assistant", "content": "ok"}]}
    chats.write_text(json.dumps(long) + "\n" + json.dumps(long) + "\n")
    cfg = _short_model_run(tmp_path, "sft", tok_dir, 32, {"kind": "sft", "train_path": str(chats)})
    cfg["data"]["global_batch_size"] = 2
    cfg["data"] |= {"max_tokens_per_micro_batch": 512, "max_length": 256}
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--no-progress"]) == 2
    _one_line(capsys, "data.train_path: its longest sample", "trained for 32 positions")


def test_plan_refuses_a_global_batch_the_gpus_cannot_split(capsys):
    assert main(["plan", "qwen2.5-1.5b", "--gpus", "2", "--global-batch", "3"]) == 2
    _one_line(capsys, "--global-batch 3 is not a multiple of --gpus x --micro-batch = 2")


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs /sys, where no folder can be made")
def test_an_export_out_that_cannot_be_made_is_one_line(model_dir, capsys):
    assert main(["export", "--model", str(model_dir), "--out", "/sys/infir2-export-test"]) == 2
    _one_line(capsys, "--out", "/sys")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--temperature", "-1"], "--temperature must be > 0"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--greedy", "--n", "2"], "--greedy is deterministic: it takes --n 1"),
        (["--precision", "recipe", "--recipe", "fp4"], "--recipe: unknown FP8 recipe 'fp4'"),
    ],
)
def test_eval_names_the_flag_and_writes_nothing(model_dir, tmp_path, capsys, extra, needle):
    out = tmp_path / "runs" / "eval"
    assert main(["eval", "--model", str(model_dir), "--limit", "1", "--out", str(out), *extra]) == 2
    _one_line(capsys, needle)
    assert not (tmp_path / "runs").exists()


def test_export_and_plan_name_the_flag_or_file(model_dir, tmp_path, capsys):
    out = tmp_path / "x"
    assert main(["export", "--model", str(model_dir), "--out", str(out), "--max-shard-size", "abc"]) == 2
    _one_line(capsys, "--max-shard-size: shard size 'abc'")
    (model_dir / "config.json").write_text("{broken")
    assert main(["export", "--model", str(model_dir), "--out", str(out)]) == 2
    _one_line(capsys, f"{model_dir / 'config.json'}: not valid JSON")
    assert not out.exists()
    assert main(["plan", "qwen2.5-1.5b", "--loss-chunk-tokens", "banana"]) == 2
    _one_line(capsys, "--loss-chunk-tokens: expected auto, 0 or a number of tokens, got 'banana'")
