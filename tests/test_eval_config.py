"""`infir2 eval`'s typed config: the one builder turns the command line into a frozen ``EvalConfig``; the
same record is a YAML config that `infir2 config` checks by the flags' rules and prints resolved, and
what it prints reads back to the config built from the command line."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from infir2.cli import build_parser, main
from infir2.eval.builder import eval_config, load_eval_config
from infir2.eval.config import EvalConfig, save_eval_config
from infir2.generation.vllm_engine import VllmSettings


def _built(*flags: str) -> EvalConfig:
    argv = ["eval", *flags]
    return eval_config(build_parser(argv).parse_args(argv))


@pytest.fixture
def as_if_vllm(monkeypatch):
    import infir2.generation.vllm_engine as v

    monkeypatch.setattr(v, "require_vllm", lambda key="engine": None)  # as if installed
    monkeypatch.setattr(v, "fp8_unsupported", lambda: None)


CASES = {
    "builtin recipe": ["--model", "m", "--precision", "recipe", "--recipe", "blockwise", "--n", "4"],
    "builtin fp8": ["--model", "m", "--precision", "fp8", "--scale-encoding", "fp32", "--greedy"],
    "preset": [
        "--model",
        "m",
        "--preset",
        "aime24",
        "--data",
        "a.jsonl",
        "--no-system-prompt",
        "--limit",
        "2",
    ],
    "server": [
        *("--engine", "server", "--model", "infir2", "--tokenizer", "t", "--base-url", "http://h:8000"),
        *("--extra-body", '{"top_k": -1}', "--concurrency", "3", "--max-new-tokens", "77"),
    ],
    "vllm": ["--engine", "vllm", "--model", "m", "--max-model-len", "64", "--no-enforce-eager"],
    "loss": ["--model", "m", "--perplexity", "tokens", "--seq-len", "256", "--batch-size", "2"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_eval_config_round_trips_through_infir2_config(case, tmp_path, capsys, as_if_vllm):
    cfg = _built(*CASES[case], "--out", str(tmp_path / "out"))
    save_eval_config(cfg, tmp_path / "eval.yaml")
    assert load_eval_config(tmp_path / "eval.yaml") == cfg  # read back as the builder made it
    assert main(["config", str(tmp_path / "eval.yaml")]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == yaml.safe_load(yaml.safe_dump(dataclasses.asdict(cfg)))
    (tmp_path / "printed.yaml").write_text(yaml.safe_dump(printed))
    assert load_eval_config(tmp_path / "printed.yaml") == cfg
    assert not (tmp_path / "out").exists()  # checked, nothing run


def test_the_builder_fills_what_the_flags_leave_and_the_engine_gets_its_settings(as_if_vllm):
    preset = _built(*CASES["preset"])
    assert (preset.benchmark.n, preset.sampling.max_new_tokens) == (32, 31000)  # the preset's
    assert (
        preset.sampling.max_new_tokens_from == "--preset aime24's" and preset.benchmark.system_prompt is None
    )
    assert _built(*CASES["server"]).server.extra_body == {"top_k": -1}
    assert _built(*CASES["vllm"]).engine == VllmSettings(max_model_len=64, enforce_eager=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset.benchmark.n = 1  # type: ignore[misc]


def test_a_bad_eval_config_is_refused_naming_the_file_and_the_key(tmp_path, capsys):
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "m"}, "sampling": {"top_p": 2}}))
    assert main(["config", str(path)]) == 2
    assert f"{path}: --top-p must be in (0, 1], got 2.0" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({"model": {"path": "m"}, "sampling": {"topp": 0.5}}))
    with pytest.raises(ValueError, match=r"eval\.yaml: sampling\.topp: unknown key"):
        load_eval_config(path)
    path.write_text(yaml.safe_dump({"model": {"path": "m"}, "benchmark": {"n": 1}, "engine": {"dtype": "x"}}))
    with pytest.raises(ValueError, match=r"eval\.yaml: engine\.dtype: the builtin engine has no settings"):
        load_eval_config(path)
    path.write_text(yaml.safe_dump({"model": {"path": "m"}, "generation": {"precision": "recipe"}}))
    with pytest.raises(ValueError, match=r"eval\.yaml: --precision recipe needs --recipe NAME"):
        load_eval_config(path)
    assert main(["config", str(path), "--set", "generation.recipe=blockwise"]) == 0


def test_infir2_config_keys_knows_evals_keys(capsys):
    assert main(["config", "--keys", "--stage", "eval"]) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out.replace("\n      ", "\n  # "))  # meanings as comments
    cfg = EvalConfig()
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            assert f.metadata.get("help"), f"{section.name}.{f.name} has no meaning"
            assert printed[section.name][f.name] == f.default, f.name
    assert "engine:  # with generation.engine: vllm\n  tensor_parallel_size: 1" in out
