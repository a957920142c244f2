"""Runs the Triton kernel checks of ``triton_interpreter_cases.py`` on CPU, in a fresh process with
``TRITON_INTERPRET=1`` set before Triton is imported (see that file for what is and is not checked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (the test extra: pip install -e '.[test]')")

CASES = Path(__file__).with_name("triton_interpreter_cases.py")


@pytest.mark.slow
def test_triton_kernels_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=CASES.parent.parent)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
