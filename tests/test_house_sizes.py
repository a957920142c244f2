"""The house's size bars over the whole of ``src/infir2`` (CONTRIBUTING.md, docs/ARCHITECTURE.md): no
file over 500 lines, and no function over 70 lines in ``tools/`` either (``tests/test_layering.py``
holds the stages and the layers under them to the same 70)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "infir2"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 70


def test_no_file_in_src_is_over_500_lines():
    long = [
        f"{p.relative_to(PACKAGE)}: {n} lines"
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not long, "files over 500 lines (split them):\n" + "\n".join(long)


def test_no_function_in_tools_is_over_70_lines():
    long = []
    for path in sorted((PACKAGE / "tools").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "functions over 70 lines in tools/ (split them):\n" + "\n".join(long)


def test_the_bars_see_a_long_file_and_a_long_function(tmp_path):
    """The checks themselves: a planted 501-line file and a 71-line function are over the bars."""
    body = "def f():\n" + "    x = 1\n" * 70
    assert len(body.splitlines()) == 71 > MAX_FUNCTION_LINES
    node = ast.parse(body).body[0]
    assert node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES  # type: ignore[attr-defined]
    assert len(("x = 1\n" * 501).splitlines()) > MAX_FILE_LINES
