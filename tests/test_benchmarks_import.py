"""Every script in benchmarks/ imports: a helper one script takes from another (or from infir2) that a
refactor renamed fails here, not on the day someone reruns the benchmark to re-measure a figure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: one process imports them all, each under its own name (their ``main`` guards keep them from running)
_IMPORT_ALL = """
import importlib.util, sys, traceback
failed = []
sys.path.insert(0, sys.argv[1])
for path in sys.argv[2:]:
    spec = importlib.util.spec_from_file_location("bench_" + path.rsplit("/", 1)[1][:-3], path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    try:
        spec.loader.exec_module(module)
    except Exception:
        failed.append(path + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_benchmark_script_imports():
    scripts = sorted(str(p) for p in BENCHMARKS.glob("*.py"))
    assert len(scripts) > 30, scripts  # the glob found the folder
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, str(BENCHMARKS), *scripts],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
