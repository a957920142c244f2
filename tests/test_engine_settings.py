"""An engine's settings are declared once, in its own module: its settings dataclass (``generation.knob``
fields) is what ``rollout.engine``'s ``engine`` section, ``infir2 config --keys`` and ``infir2 eval``'s
flags are read from. The engine below is added by one module (``_register``, what an adapter's module
does) and nothing else; RL's config and eval then know its setting."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import make_tiny_model
from infir2.cli import main
from infir2.export import export_model
from infir2.generation import ENGINES, EngineOptions, EngineTraits, knob, register_engine
from infir2.rl import parse_rl_config
from train_synthetic import one_thread

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _register(built: list) -> None:
    """The new engine's whole module: its settings (one knob) and one ``register_engine`` call. It
    generates with the builtin engine's machinery and keeps the settings it was built with."""

    @dataclass(frozen=True, kw_only=True)
    class EchoSettings:
        beam_width: int = knob(1, "beams kept while decoding")

        def __post_init__(self) -> None:
            if self.beam_width < 1:
                raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")

    def factory(name: str, options: EngineOptions, settings: EchoSettings | None):
        built.append(settings)
        return ENGINES["builtin"].factory(name, options, None)

    register_engine("echo", factory, settings=EchoSettings, traits=EngineTraits(True, ("high",), True))


@pytest.fixture
def echo(monkeypatch) -> list:
    monkeypatch.setitem(ENGINES, "echo", ENGINES["builtin"])  # removed again after the test
    built: list = []
    _register(built)
    return built


def test_rl_config_reads_a_new_engines_setting_from_its_engine_section(echo, capsys):
    base = {"data": {"prompts_path": "p.jsonl"}, "rollout": {"engine": "echo", "precision": "high"}}
    settings_type = ENGINES["echo"].settings
    assert parse_rl_config(base).engine == settings_type(beam_width=1)  # its default
    assert parse_rl_config({**base, "engine": {"beam_width": 4}}).engine == settings_type(beam_width=4)
    with pytest.raises(ValueError, match=r"^rl\.yaml: engine: beam_width must be >= 1, got 0$"):
        parse_rl_config({**base, "engine": {"beam_width": 0}}, "rl.yaml")
    with pytest.raises(ValueError, match=r"^rl\.yaml: engine\.beam: unknown key \(known keys: beam_width\)"):
        parse_rl_config({**base, "engine": {"beam": 2}}, "rl.yaml")
    with pytest.raises(ValueError, match=r"^rl\.yaml: engine\.beam_width: expected an integer"):
        parse_rl_config({**base, "engine": {"beam_width": "wide"}}, "rl.yaml")
    builtin = {"data": {"prompts_path": "p.jsonl"}, "engine": {"beam_width": 4}}
    with pytest.raises(
        ValueError, match=r"^rl\.yaml: engine\.beam_width: the builtin engine has no settings"
    ):
        parse_rl_config(builtin, "rl.yaml")
    assert main(["config", "--keys", "--stage", "rl"]) == 0
    out = capsys.readouterr().out
    assert "engine:  # with rollout.engine: echo\n  beam_width: 1\n      beams kept while decoding" in out


def test_eval_generates_a_flag_for_a_new_engines_setting(echo, tmp_path, tiny_tokenizer, capsys):
    model = export_model(make_tiny_model(hidden=128), tiny_tokenizer, tmp_path / "model", fmt="fp32")
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert (
        "echo engine (its settings' fields): --beam-width BEAM_WIDTH beams kept while decoding (default: 1)"
        in shown
    )
    argv = ["eval", "--model", str(model), "--max-new-tokens", "4", "--limit", "1", "--greedy"]
    assert main([*argv, "--out", str(tmp_path / "e"), "--engine", "echo", "--beam-width", "3"]) == 0
    assert echo == [ENGINES["echo"].settings(beam_width=3)]  # the flag reached the engine as its setting
    assert main([*argv, "--out", str(tmp_path / "b"), "--beam-width", "3"]) == 2
    assert "--beam-width is a flag of --engine echo, not of --engine builtin" in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "z"), "--engine", "echo", "--beam-width", "0"]) == 2
    assert "--engine echo: beam_width must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not (tmp_path / "z").exists()
    assert Path(tmp_path / "e" / "summary.json").is_file()
