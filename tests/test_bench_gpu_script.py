"""``benchmarks/gpu_bench.py`` on CPU: its dry run (tiny shapes, the same code paths), a phase that raises,
and the imports of its path on a machine without the packages the GPU image lacks."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_bench.py"
#: what the GPU image (torch, triton, transformers and their dependencies) may not have
ABSENT = ("math_verify", "tensorboard", "matplotlib", "torchao", "ml_dtypes", "accelerate", "peft", "pyarrow")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_phase_that_raises_is_recorded_and_the_next_one_runs(bench, tmp_path, monkeypatch):
    """gemm raises after one row: its row and error are kept, quantize still runs, and the JSON and text
    on disk are those of every phase that had ended when the next one started."""
    seen_on_disk = {}
    real_gemm, real_quantize = bench.phase_gemm, bench.phase_quantize

    def gemm_then_fail(device, sizes, backends, rows):
        real_gemm(device, sizes, backends, rows)
        del rows[1:]
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def quantize_after_reading_the_report(device, sizes, backends, rows):
        seen_on_disk.update(json.loads((tmp_path / "gpu_bench.json").read_text())["phases"])
        real_quantize(device, sizes, backends, rows)

    monkeypatch.setattr(bench, "phase_gemm", gemm_then_fail)
    monkeypatch.setattr(bench, "phase_quantize", quantize_after_reading_the_report)
    rc = bench.main(["--device", "cpu", "--out", str(tmp_path), "--phases", "env,gemm,quantize"])
    assert rc == 1
    assert seen_on_disk["env"]["status"] == "ok" and seen_on_disk["gemm"]["status"] == "error"
    phases = json.loads((tmp_path / "gpu_bench.json").read_text())["phases"]
    assert list(phases) == ["env", "gemm", "quantize"]
    assert phases["gemm"]["error"].startswith("RuntimeError: CUDA error") and len(phases["gemm"]["rows"]) == 1
    assert "gemm_then_fail" in phases["gemm"]["traceback"]
    assert phases["quantize"]["status"] == "ok" and len(phases["quantize"]["rows"]) == 4
    assert all(isinstance(r["reference GB/s"], float) for r in phases["quantize"]["rows"])
    text = (tmp_path / "gpu_bench.txt").read_text()
    assert "## gemm: error" in text and "## quantize: ok" in text and "illegal memory access" in text


def test_phase_selection_and_the_budget(bench, tmp_path):
    assert bench._phases(bench._parser().parse_args(["--checks-only"])) == ["env", "checks"]
    assert "checks" not in bench._phases(bench._parser().parse_args(["--skip-checks"]))
    rc = bench.main(["--device", "cpu", "--out", str(tmp_path), "--phases", "env,gemm", "--budget-s", "0"])
    phases = json.loads((tmp_path / "gpu_bench.json").read_text())["phases"]
    assert rc == 1 and phases["env"]["status"] == "ok" and phases["gemm"]["status"] == "skipped"


def test_moe_phase_checks_before_it_times_and_fails_on_a_missed_floor(bench, tmp_path, monkeypatch):
    """Per projection: SQNR against the bf16 grouped GEMM over the floors, the CPU emulation, the empty
    expert; then one timing row per shape. A floor the FP8 GEMM cannot meet marks the phase failed."""
    assert bench.main(["--device", "cpu", "--out", str(tmp_path / "ok"), "--phases", "moe"]) == 0
    rows = json.loads((tmp_path / "ok" / "gpu_bench.json").read_text())["phases"]["moe"]["rows"]
    checks = [r for r in rows if r["check"] in ("gate_up", "down")]
    assert [r["check"] for r in checks] == ["gate_up", "down"] and all(r["ok"] for r in checks)
    assert all(27 <= r["sqnr y dB"] < 40 and r["sqnr dw dB"] >= 26 for r in checks)  # FP8, not exact
    assert all(r["diff vs cpu"] < 1e-3 and r["empty expert dw = 0"] for r in checks)
    assert isinstance(rows[-1]["bf16 ms"], float) and isinstance(rows[-1]["fast_emulated ms"], float)
    monkeypatch.setitem(bench.MOE_SQNR_FLOORS, "dx", 60.0)
    assert bench.main(["--device", "cpu", "--out", str(tmp_path / "strict"), "--phases", "moe"]) == 1
    phase = json.loads((tmp_path / "strict" / "gpu_bench.json").read_text())["phases"]["moe"]
    assert phase["status"] == "failed" and not any(r.get("ok") for r in phase["rows"])
    assert isinstance(phase["rows"][-1]["bf16 ms"], float)  # the timings still ran


def test_pytest_comes_from_the_wheels_folder_when_not_installed(bench, tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "fakepytest-1.0-py3-none-any.whl", "w") as z:
        z.writestr("fakepytest/__init__.py", "VERSION = 1\n")
    assert bench._pytest_path(tmp_path, wheels) == ""  # installed here: nothing to add
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)
    assert bench._pytest_path(tmp_path, tmp_path / "none") is None
    folder = bench._pytest_path(tmp_path, wheels)
    assert (Path(folder) / "fakepytest" / "__init__.py").read_text() == "VERSION = 1\n"


def test_check_rows_count_the_verdicts(bench):
    lines = [
        "tests/gpu/t.py::test_a PASSED [ 33%]\n",
        "tests/gpu/t.py::test_b FAILED [ 66%]\n",
        "tests/gpu/t.py::test_c SKIPPED (needs two GPUs) [100%]\n",
        "FAILED tests/gpu/t.py::test_b - AssertionError: bits differ\n",
        "== 1 failed, 1 passed, 1 skipped in 3.00s ==\n",
    ]
    rows = bench._check_rows(lines, 1)
    assert rows[0] == {
        "returncode": 1,
        "passed": 1,
        "failed": 1,
        "errors": 0,
        "skipped": 1,
        "summary": lines[-1].strip(),
    }
    assert rows[1:] == [{"outcome": "FAILED", "test": "tests/gpu/t.py::test_b - AssertionError: bits differ"}]


@pytest.mark.slow
def test_the_whole_dry_run_without_the_packages_the_gpu_image_lacks(tmp_path):
    """Every phase (checks: ``pytest tests/gpu``, which skips on CPU) in a process where the packages of
    ``ABSENT`` cannot be imported (a ``sitecustomize`` on PYTHONPATH, so the checks' process too)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import sys\nfor name in {ABSENT!r}:\n    sys.modules[name] = None\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT / "src")]),
        "OMP_NUM_THREADS": "1",
    }
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), "--layers", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    phases = json.loads((out / "gpu_bench.json").read_text())["phases"]
    assert list(phases) == ["env", "checks", "gemm", "quantize", "moe", "step"]
    assert all(p["status"] == "ok" for p in phases.values()), phases
    assert all("error" not in row for p in phases.values() for row in p["rows"]), phases
    assert phases["checks"]["rows"][0]["passed"] >= 1  # the collection test of tests/gpu
    assert [r["arm"] for r in phases["step"]["rows"]] == ["bf16", "fp8[fast_emulated]"]
    assert all(r["ok"] for r in phases["moe"]["rows"] if "ok" in r) and len(phases["moe"]["rows"]) == 3


def test_the_vllm_phase_is_named_to_run_and_says_why_it_cannot_without_vllm(bench, tmp_path, monkeypatch):
    """Not among the default phases (the GPU image has no vLLM); named without vLLM installed, it is
    recorded as an error naming how to install it, and the other phases still run."""
    assert "vllm" in bench.PHASES and "vllm" not in bench.DEFAULT_PHASES
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    rc = bench.main(["--device", "cpu", "--out", str(tmp_path), "--phases", "env,vllm"])
    phases = json.loads((tmp_path / "gpu_bench.json").read_text())["phases"]
    assert rc == 1 and phases["env"]["status"] == "ok"
    assert (
        phases["vllm"]["error"]
        == "RuntimeError: vLLM is not installed here (pip install vllm; on a CPU: .ci/vllm-env)"
    )


def test_vllm_bench_refuses_bad_arguments_in_one_line(tmp_path):
    script = ROOT / "benchmarks" / "vllm_bench.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for args, line in (
        (["--arm", "fp8", "--device", "cpu", "--layers", "0"], "vllm_bench.py: --layers must be >= 1, got 0"),
        (["--arm", "int4"], "argument --arm: invalid choice: 'int4'"),
    ):
        done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True)
        assert done.returncode == 2 and line in done.stderr, done.stderr
    if not torch_cuda():
        done = subprocess.run(
            [sys.executable, str(script), "--arm", "high"], env=env, capture_output=True, text=True
        )
        assert done.returncode == 2 and "--device cuda: no CUDA device here" in done.stderr, done.stderr


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
