"""The house's file-size bar over the whole of ``src/infir2``: no file over 500 lines (functions over
70 lines: ``tests/test_layering.py``)."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "infir2"
MAX_FILE_LINES = 500


def long_files(root: Path) -> list[str]:
    """The Python files under ``root`` over the bar, with their line counts."""
    return [
        f"{p.relative_to(root)}: {n} lines"
        for p in sorted(root.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]


def test_no_file_in_src_is_over_500_lines():
    long = long_files(PACKAGE)
    assert not long, "files over 500 lines (split them):\n" + "\n".join(long)


def test_the_bar_sees_a_long_file(tmp_path):
    """The check itself: a planted 501-line file is over the bar, a 500-line one is not."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "ok.py").write_text("x = 1\n" * 500)
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * 501)
    assert long_files(tmp_path) == ["sub/long.py: 501 lines"]
