"""The ``infir2`` command line: every command shown in the README and docs parses; --help and --version.

Commands are taken from the fenced (```) and indented code blocks of the documents; each is parsed
by the real parser (``build_parser(argv).parse_args(argv)``) without being run.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from infir2.cli import COMMANDS, build_parser

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _code_lines(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            lines.append(line.strip())
    joined: list[str] = []  # join backslash continuations
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line
        else:
            joined.append(line)
    return joined


def _commands(path: Path) -> list[list[str]]:
    found = []
    for line in _code_lines(path.read_text(encoding="utf-8")):
        segment: list[str] = []
        for word in [*shlex.split(line, comments=True), "&&"]:  # one shell line may chain commands
            if word not in ("&&", "||", ";"):
                segment.append(word)
                continue
            if segment[:1] and segment[0].split("/")[-1] == "infir2":  # infir2, .venv/bin/infir2
                found.append(segment[1:])
            elif "infir2.cli" in segment:  # torchrun ... -m infir2.cli train ...
                found.append(segment[segment.index("infir2.cli") + 1 :])
            segment = []
    return found


CASES = [(path.relative_to(ROOT).as_posix(), argv) for path in DOCS for argv in _commands(path)]


def test_the_readme_shows_the_pipeline():
    shown = {argv[0] for doc, argv in CASES if doc == "README.md" and argv}
    assert {"demo", "prepare-cpt", "train", "eval", "export", "bench"} <= shown, shown


@pytest.mark.parametrize(("doc", "argv"), CASES, ids=[f"{d}:{' '.join(a)[:40]}" for d, a in CASES])
def test_documented_command_parses(doc, argv):
    if "--help" in argv:
        with pytest.raises(SystemExit) as exit_:
            build_parser(argv).parse_args(argv)
        assert exit_.value.code == 0
        return
    args = build_parser(argv).parse_args(argv)
    assert args.command in COMMANDS and callable(args._run), (doc, argv)


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "infir2.cli", *argv], capture_output=True, text=True, env=env, timeout=120
    )


def test_top_level_help_and_version_import_no_torch():
    """`infir2 --help` lists every command and, like --version, never imports torch (it stays fast)."""
    probe = "import sys, infir2.cli as c\ntry:\n    c.main(sys.argv[1:])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    for flag in ("--help", "--version"):
        out = subprocess.run(
            [sys.executable, "-c", probe, flag],
            capture_output=True,
            text=True,
            timeout=120,
            env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        )
        assert out.returncode == 0 and out.stdout.strip().endswith("False"), (flag, out.stdout, out.stderr)
    help_text = _cli("--help").stdout
    assert all(name in help_text for name in COMMANDS)
    import infir2

    assert _cli("--version").stdout.startswith(f"infir2 {infir2.__version__} ")


def test_documented_run_folders_are_what_training_writes():
    """`runs/<name>/hf` and `runs/<name>/checkpoints` in docs and --help name a shipped config's run folder."""
    import yaml

    configs = sorted((ROOT / "src/infir2/configs").glob("*.yaml"))
    run_dirs = {
        f"{c['run']['out_dir']}/{c['run']['name']}" for c in (yaml.safe_load(p.read_text()) for p in configs)
    }
    sources = [*DOCS, *sorted((ROOT / "src/infir2").rglob("command.py")), *configs]
    cited = {
        (p.name, m)
        for p in sources
        for m in re.findall(r"\b(runs/[\w.-]+)/(?:hf|checkpoints|final)\b", p.read_text())
    }
    assert cited, "no run folder is cited"
    assert {(name, m) for name, m in cited if m not in run_dirs} == set(), run_dirs


def test_subcommand_help_shows_defaults():
    parser = build_parser(["eval"])
    sub = next(a for a in parser._actions if a.dest == "command").choices["eval"]  # type: ignore[attr-defined]
    text = sub.format_help()
    assert "(default: 0.65)" in text and "(default: 0.95)" in text
    assert re.search(r"--max-new-tokens.*\(default:\s+32768\)", text, re.S)


@pytest.mark.slow
def test_model_loads_through_the_cli_keep_torchao_out(tmp_path):
    """torchao is a test oracle: a command that loads a model neither imports it nor prints its warnings."""
    from conftest import make_tiny_model

    make_tiny_model().save_pretrained(tmp_path / "model")
    probe = (
        "import sys, infir2.cli as c\nrc = c.main(sys.argv[1:])\n"
        "print('torchao imported:', 'torchao' in sys.modules and sys.modules['torchao'] is not None, rc)"
    )
    argv = ["eval", "--model", str(tmp_path / "model"), "--perplexity", str(tmp_path / "no-tokens")]
    out = subprocess.run(
        [sys.executable, "-c", probe, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip().endswith("torchao imported: False 2"), (out.stdout, out.stderr)
    assert "torchao" not in out.stderr and "_pytree" not in out.stderr, out.stderr


def test_hiding_torchao_is_undone_after_the_command():
    import importlib.util

    from infir2.cli import _without_torchao

    had = "torchao" in sys.modules
    with _without_torchao():
        if not had:
            assert importlib.util.find_spec("torchao") is None
    assert sys.modules.get("torchao", "absent") is not None  # never left blocked


def test_recipe_citations_name_sections_that_exist():
    """Code and docs cite `RECIPE.md section N`; docs/RECIPE.md exists and has a section N."""
    recipe = (ROOT / "docs" / "RECIPE.md").read_text(encoding="utf-8")
    sections = set(re.findall(r"^## (\d+)\. ", recipe, re.M))
    files = [
        *DOCS,
        ROOT / "BENCHMARKS.md",
        *sorted((ROOT / "docs" / "benchmarks").glob("*.md")),
        *(ROOT / "src").rglob("*.py"),
        *(ROOT / "src").rglob("*.yaml"),
        *(ROOT / "tests").glob("*.py"),
    ]
    cited = {
        (p.name, n) for p in files for n in re.findall(r"RECIPE\.md`? (?:section|§) ?(\d+)", p.read_text())
    }
    assert cited and {(name, n) for name, n in cited if n not in sections} == set()
