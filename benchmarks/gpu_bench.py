"""The first thing to run on a CUDA GPU: correctness checks, then the numbers of the FP8 fast path.

Runs from the source tree with the machine's own packages (no install: torch >= 2.11, triton,
transformers; nothing else is imported on this path -- no math-verify, tensorboard or matplotlib)::

    PYTHONPATH=src python3 benchmarks/gpu_bench.py --out $OUT/bench      # H100 / H200: about 6-8 minutes

Phases (``--phases`` picks some; each is guarded: an exception is recorded with its traceback and the
next phase runs; ``--budget-s`` skips the phases that would start after the budget is spent):

1. env      - GPU, capability, torch / CUDA / triton / transformers versions, and per recipe the backend
              chain ``bind`` gives with the reason each backend is skipped (a few seconds).
2. checks   - ``pytest tests/gpu`` in a subprocess with a timeout (``--checks-timeout``, 300 s): Triton
              quantization bit for bit against the reference, the block-scaled GEMMs against the
              emulated one, ``Fp8Linear`` on every GPU backend, no host sync in a step, offsets past
              2**31, FSDP2 under the CUDA sanitizer (2-4 minutes). Without pytest on the machine,
              pure-Python wheels in ``--wheels`` (default ``gpu-wheels/``: pytest, pluggy, iniconfig,
              packaging) are unpacked and used; otherwise the phase records why it could not run.
3. gemm     - TFLOP/s of each GEMM of a layer (fprop, dgrad with the weight as a transposed view and as
              the K-major copy, wgrad) at the Qwen2.5-1.5B / 7B projection shapes and 8192 tokens, for
              FP8 blockwise on cuBLAS (``scaled_mm``) and Triton beside a bf16 ``torch.mm`` of the same
              shape and layout (under a minute, Triton compiles included).
4. quantize - GB/s of each quantization (1x128, 1x128+128x1 fused, 128x128) on Triton and the plain-torch
              reference beside a device copy, timed with CUDA events over ``--calls`` calls (seconds).
5. moe      - the experts' grouped GEMMs at DeepSeek-V3 (hidden 7168, expert width 2048; a GPU's 32 of
              256 experts under 8-way expert parallelism) and Qwen3-30B-A3B (2048 / 768, 128 experts)
              shapes, 65536 routed rows (8192 tokens x top-8), uneven, one expert empty
              (``infir2.tools.bench.moe``). Correctness first, per projection (gate_up, down) and backend:
              SQNR of the output, dgrad and wgrad against the bf16 grouped GEMM (floors 27 / 26 / 26 dB),
              ``calc_diff < 1e-3`` against the CPU emulation of the same operands on three experts
              (385 / 0 / 129 rows), the empty expert's zero gradient; a failed check marks the phase
              failed. Then one MoE MLP's forward + backward, bf16 (``grouped_mm``) vs FP8 on each
              backend: ms, TFLOP/s. The FP8 path loops over experts with the dense kernels, the row
              counts given on the host (a model reads them once per block: ``# MoE routing:``).
6. step     - the trainer's step on a Qwen2.5-1.5B-shaped model (``--layers`` 28, seq 8192, BF16
              ``lm_head``, fp32 masters, bf16 autocast, chunked loss, fused AdamW) inside
              ``cache_fp8_weights``: BF16 vs FP8 on each backend, step time (CUDA events), TFLOP/s and
              peak memory, with the ratios to compare with InfiR2's 0.78x time and 0.86x memory
              (1-2 minutes).
7. vllm     - (only when named: ``--phases env,vllm``; needs vLLM installed) the vllm engine's rollouts
              (``benchmarks/vllm_bench.py``, each arm in a process of its own): rollout tokens/s of the
              BF16 (``rollout.precision: high``, bf16) and FP8 (``rollout.precision: fp8``: the FP8 export's
              weights, bf16 activations) engines on a random Qwen2.5-1.5B-shaped model (64 prompts x 8
              samples, 256 + 512 tokens), the refit time per update, and the rollout-vs-trainer mismatch
              of each (mean / max |dlogp|; the FP8 pair's is FP8's own). Not run on a GPU yet.

Writes ``<out>/gpu_bench.json`` (every phase: status, seconds, rows, error) and ``<out>/gpu_bench.txt``
(the tables) after every phase, and ``<out>/checks.txt`` (the pytest output). Exit status: 0 when every
phase ran and the checks passed, 1 otherwise. ``--device cpu`` is a dry run of the same code paths at
tiny shapes (what the CPU suite runs).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from infir2.fp8 import RECIPES, get_recipe
from infir2.fp8.formats import BLOCK
from infir2.fp8.numerics import calc_diff, sqnr
from infir2.fp8.recipe import Cast
from infir2.kernels import BACKENDS, Operand, bind
from infir2.tools.bench.measure import QWEN25_LAYERS, StepModel, device_name, step_flops, step_model_config
from infir2.tools.bench.moe import MOE_GPU_SHAPES, MoeShape, grouped_projection, mlp_step, routed_counts

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("env", "checks", "gemm", "quantize", "moe", "step", "vllm")
#: what runs without --phases: vllm needs vLLM installed beside torch (the GPU image has none)
DEFAULT_PHASES = PHASES[:-1]
#: the grouped FP8 GEMM against the bf16 grouped GEMM (torchao's floors, dB): output, gradients
MOE_SQNR_FLOORS = {"y": 27.0, "dx": 26.0, "dw": 26.0}
#: the GPU grouped GEMM against the CPU emulation of the same operands (the dense kernels' bound)
MOE_EMULATION_DIFF = 1e-3
FP8_BACKENDS = ("scaled_mm", "triton")


@dataclass(frozen=True)
class Sizes:
    """What the phases measure: the GPU's shapes, or tiny ones for the CPU dry run."""

    tokens: int = 8192
    models: tuple[str, ...] = ("1.5B", "7B")
    scale: int = 1  # divides the layer shapes
    step: StepModel = field(default_factory=StepModel)
    warmup: int = 3
    reps: int = 5  # timed repetitions (the median is reported)
    calls: int = 20  # calls per timed repetition (CUDA events around the loop)
    steps: int = 4  # timed training steps per arm (after one warm-up step)
    moe: tuple[MoeShape, ...] = MOE_GPU_SHAPES
    # rows per expert of the CPU-emulation check (uneven, an empty expert; small enough for a CPU)
    moe_emulated: tuple[int, ...] = (385, 0, 129)


GPU = Sizes()
CPU_DRY_RUN = Sizes(
    tokens=256,
    models=("1.5B",),
    scale=6,
    step=StepModel(
        hidden=128, intermediate=256, heads=2, kv_heads=1, head_dim=64, layers=2, vocab=512, seq=256
    ),
    warmup=1,
    reps=1,
    calls=1,
    steps=1,
    moe=(MoeShape("tiny", 256, 128, 4, 600),),
)


# ----------------------------------------------------------------------------------------------
# the report: every phase recorded, written after each


class Report:
    """The JSON and text outputs, rewritten whenever a phase (or a part of one) ends."""

    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        self.out = out
        self.data: dict[str, Any] = {"meta": meta, "phases": {}}
        out.mkdir(parents=True, exist_ok=True)

    def phase(self, name: str) -> dict[str, Any]:
        return self.data["phases"].setdefault(name, {"status": "running", "seconds": None, "rows": []})

    def write(self) -> None:
        (self.out / "gpu_bench.json").write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        (self.out / "gpu_bench.txt").write_text(render(self.data) + "\n")


def run_phase(report: Report, name: str, fn: Callable[[list[dict]], None]) -> bool:
    """Run one phase, appending its rows; an exception is recorded (the rows so far are kept)."""
    entry = report.phase(name)
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        fn(entry["rows"])
        entry["status"] = entry.get("status_override", "ok")
    except Exception as e:  # every failure is reported, then the next phase runs
        entry["status"] = "error"
        entry["error"] = f"{type(e).__name__}: {e}"
        entry["traceback"] = traceback.format_exc()
        print(entry["traceback"], file=sys.stderr, flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    entry.pop("status_override", None)
    entry["seconds"] = round(time.perf_counter() - t0, 1)
    report.write()
    print(f"== {name}: {entry['status']} ({entry['seconds']} s)", flush=True)
    return entry["status"] == "ok"


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def render(data: dict[str, Any]) -> str:
    """Each phase as a header line and a plain table of its rows."""
    meta = data["meta"]
    lines = [f"{meta.get('device')}  torch {meta.get('torch')}  CUDA {meta.get('cuda')}  {meta.get('date')}"]
    for name, entry in data["phases"].items():
        lines += ["", f"## {name}: {entry['status']} ({entry['seconds']} s)"]
        if "error" in entry:
            lines.append(f"   {entry['error']}")
        rows = entry["rows"]
        if rows:
            keys = list(dict.fromkeys(k for r in rows for k in r))
            cells = [keys, *[[_value(r.get(k, "")) for k in keys] for r in rows]]
            widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
            lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# timing


def time_ms(fn: Callable[[], Any], device: torch.device, sizes: Sizes) -> float:
    """Median ms per call of ``fn``: CUDA events around ``sizes.calls`` calls, no sync in between."""
    for _ in range(sizes.warmup):
        fn()
    times = []
    for _ in range(sizes.reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(sizes.calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / sizes.calls)
        else:  # the CPU dry run
            t0 = time.perf_counter()
            for _ in range(sizes.calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / sizes.calls)
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------------------------------------
# 1. env, 2. checks


def phase_env(device: torch.device, rows: list[dict]) -> None:
    """Per recipe: the backend chain on this device and why each other backend is skipped."""
    for name, recipe in RECIPES.items():
        if not recipe.enabled:
            continue
        skipped = {b: BACKENDS[b].why_unavailable(recipe, device) for b in BACKENDS}
        chain = bind(recipe, device).chain
        row = {"recipe": name, "chain": " > ".join(b.NAME for b in chain)}
        row.update({f"{b} unavailable": why for b, why in skipped.items() if why and b in FP8_BACKENDS})
        rows.append(row)


def _pytest_path(out: Path, wheels: Path) -> str | None:
    """A folder to put on PYTHONPATH for pytest when the machine has none (unpacked wheels), or None."""
    if importlib.util.find_spec("pytest") is not None:
        return ""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return None
    target = out / "_wheels"
    for wheel in found:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target)
    return str(target)


def _check_rows(lines: list[str], returncode: int | None) -> list[dict]:
    """pytest -v output as rows: the counts, then one row per failed, errored or skipped test."""
    verdicts = ("PASSED", "FAILED", "ERROR", "SKIPPED")
    names = ("passed", "failed", "errors", "skipped")
    counts = {
        n: sum(1 for ln in lines if "::" in ln and f" {v}" in ln)
        for n, v in zip(names, verdicts, strict=True)
    }
    rows: list[dict] = [{"returncode": returncode, **counts, "summary": lines[-1].strip() if lines else ""}]
    for ln in lines:  # the -rfEs short summary: "FAILED tests/gpu/...::test - reason"
        word, _, rest = ln.partition(" ")
        if word in verdicts[1:] and rest.strip():
            rows.append({"outcome": word, "test": rest.strip()[:200]})
    return rows


def phase_checks(out: Path, wheels: Path, timeout_s: float, entry: dict, rows: list[dict]) -> None:
    """``pytest tests/gpu`` in a subprocess, streamed and saved to ``checks.txt``; its summary as rows."""
    extra = _pytest_path(out, wheels)
    if extra is None:
        raise RuntimeError(f"pytest is not installed and {wheels} holds no wheels of it (see the module doc)")
    path = os.pathsep.join(p for p in (str(ROOT / "src"), extra, os.environ.get("PYTHONPATH", "")) if p)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(ROOT / "tests" / "gpu"),
        "-v",
        "-rfEs",
        "-p",
        "no:cacheprovider",
    ]
    env = {**os.environ, "PYTHONPATH": path}
    lines: list[str] = []
    with subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as p:
        timer = threading.Timer(timeout_s, p.kill)  # a hung test must not take the timings' time
        timer.start()
        try:
            assert p.stdout is not None
            for line in p.stdout:
                print("  " + line, end="", flush=True)
                lines.append(line)
        finally:
            timer.cancel()
    if p.returncode is not None and p.returncode < 0:
        lines.append(f"== killed after {timeout_s:.0f} s (--checks-timeout)\n")
    (out / "checks.txt").write_text("".join(lines))
    rows += _check_rows(lines, p.returncode)
    if p.returncode != 0:
        entry["status_override"] = "failed"


# ----------------------------------------------------------------------------------------------
# 3. GEMMs


def _guarded(fn: Callable[[], float]) -> float | str:
    """``fn()``, or the error's first line: one failing backend leaves the other columns."""
    try:
        return fn()
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]


def _tflops(m: int, n: int, k: int, ms: float | str) -> float | str:
    return 2 * m * n * k / (ms * 1e-3) / 1e12 if isinstance(ms, float) else ms


def _gemm_cases(t: int, n: int, k: int, device: torch.device) -> dict[str, tuple[Any, ...]]:
    """Per GEMM of a layer: (bf16 operands, the FP8 operands A and B of ``gemm_nt``, output [M, N])."""
    kernels = bind(get_recipe("blockwise"), device)
    q = kernels.quantize
    x = torch.randn(t, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device) * 0.02
    dy = torch.randn(t, n, device=device, dtype=torch.bfloat16)
    wq = q(w, Cast((BLOCK, BLOCK)))
    view = wq.t()  # [K, N]: N, the reduction dimension of dgrad, is the slow one
    k_major = Operand(view.data.contiguous(), view.scale_inv.contiguous(), view.block)
    wb = w.bfloat16()
    return {  # name: (bf16 A, bf16 B as multiplied, FP8 A, FP8 B [N', K'] for gemm_nt, (M, N, K))
        "fprop": (x, wb.t(), q(x, Cast((1, BLOCK))), wq, (t, n, k)),  # [T,K] @ [K,N]
        "dgrad view": (dy, wb, q(dy, Cast((1, BLOCK))), view, (t, k, n)),  # [T,N] @ [N,K]
        "dgrad K-major": (dy, wb, q(dy, Cast((1, BLOCK))), k_major, (t, k, n)),
        "wgrad": (
            dy.t(),
            x,
            q(dy, Cast((BLOCK, 1))).t(),
            q(x, Cast((BLOCK, 1))).t(),
            (n, k, t),
        ),  # [N,T] @ [T,K]
    }


def phase_gemm(device: torch.device, sizes: Sizes, backends: list[str], rows: list[dict]) -> None:
    """TFLOP/s of bf16 ``torch.mm`` and of each FP8 backend's block-scaled GEMM, per shape and GEMM."""
    for model in sizes.models:
        for name, k, n, _count in QWEN25_LAYERS[model]:
            k, n = k // sizes.scale, n // sizes.scale
            for gemm, (a16, b16, a, b, (m, nn, kk)) in _gemm_cases(sizes.tokens, n, k, device).items():
                row: dict[str, Any] = {"shape": f"{model} {name}", "gemm": gemm, "MxNxK": f"{m}x{nn}x{kk}"}
                bf16 = _guarded(lambda: time_ms(lambda: a16 @ b16, device, sizes))  # noqa: B023
                row["bf16 TFLOP/s"] = _tflops(m, nn, kk, bf16)
                for backend in backends:
                    be = BACKENDS[backend]
                    if not be.supports_gemm(a, b, torch.bfloat16):
                        row[f"{backend} TFLOP/s"] = "declined"
                        continue
                    ms = _guarded(lambda: time_ms(lambda: be.gemm_nt(a, b, torch.bfloat16), device, sizes))  # noqa: B023
                    row[f"{backend} TFLOP/s"] = _tflops(m, nn, kk, ms)
                    if isinstance(ms, float) and isinstance(bf16, float):
                        row[f"{backend} / bf16"] = bf16 / ms  # > 1: FP8 faster
                rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# 4. quantization


def _quantize_cases(sizes: Sizes) -> list[tuple[str, tuple[int, int], torch.dtype, tuple[Cast, ...]]]:
    row, col, weight = Cast((1, BLOCK)), Cast((BLOCK, 1)), Cast((BLOCK, BLOCK))
    cases = []
    for model in sizes.models:
        shapes = {name: (k // sizes.scale, n // sizes.scale) for name, k, n, _ in QWEN25_LAYERS[model]}
        hidden, inter = shapes["gate,up"]
        t = sizes.tokens
        cases += [
            (f"{model} act {t}x{hidden} 1x128", (t, hidden), torch.bfloat16, (row,)),
            (f"{model} act {t}x{hidden} 1x128+128x1", (t, hidden), torch.bfloat16, (row, col)),
            (f"{model} down act {t}x{inter} 1x128+128x1", (t, inter), torch.bfloat16, (row, col)),
            (f"{model} weight {inter}x{hidden} 128x128", (inter, hidden), torch.float32, (weight,)),
        ]
    return cases


def _quantized_bytes(x: torch.Tensor, casts: tuple[Cast, ...]) -> int:
    """Bytes moved: the input once, one FP8 byte per element and 4 per fp32 scale for each output."""
    m, k = x.shape
    scales = sum(math.ceil(m / c.block[0]) * math.ceil(k / c.block[1]) for c in casts)
    return x.numel() * x.element_size() + len(casts) * x.numel() + 4 * scales


def phase_quantize(device: torch.device, sizes: Sizes, backends: list[str], rows: list[dict]) -> None:
    """GB/s of each quantization on each backend and on the plain-torch reference, beside a device copy."""
    from infir2.fp8 import quantize as reference

    recipe = get_recipe("blockwise")
    for case, shape, dtype, casts in _quantize_cases(sizes):
        x = torch.randn(shape, device=device, dtype=dtype)
        copy_ms = time_ms(x.clone, device, sizes)
        row: dict[str, Any] = {"case": case, "copy GB/s": 2 * x.numel() * x.element_size() / copy_ms / 1e6}
        moved = _quantized_bytes(x, casts)
        impls: dict[str, Callable[[], Any]] = {
            "reference": lambda: [reference(x, c.block, c.fmt, c.scale_encoding) for c in casts]  # noqa: B023
        }
        for backend in backends:
            kernels = bind(recipe, device, backend)
            one = kernels.quantize if len(casts) == 1 else kernels.quantize_pair
            impls[backend] = lambda one=one: one(x, *casts)  # noqa: B023
        for impl, fn in impls.items():
            ms = _guarded(lambda: time_ms(fn, device, sizes))  # noqa: B023
            row[f"{impl} GB/s"] = moved / ms / 1e6 if isinstance(ms, float) else ms
        rows.append(row)


# ----------------------------------------------------------------------------------------------
# 5. the experts' grouped GEMMs (mixture of experts)


def _moe_operands(shape: MoeShape, device: torch.device) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per projection: (input [S, K] bf16, weight [E, N, K] fp32, output gradient [S, N] bf16)."""
    g = torch.Generator(device=device).manual_seed(0)
    s, h, i, e = shape.rows, shape.hidden, shape.inter, shape.experts

    def randn(*size: int, std: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (torch.randn(size, generator=g, device=device) * std).to(dtype)

    bf16 = torch.bfloat16
    return {
        "gate_up": (randn(s, h, dtype=bf16), randn(e, 2 * i, h, std=0.02), randn(s, 2 * i, dtype=bf16)),
        "down": (randn(s, i, dtype=bf16), randn(e, h, i, std=0.02), randn(s, h, dtype=bf16)),
    }


def _moe_check(
    operands: tuple[torch.Tensor, ...], counts: list[int], emulated: tuple[int, ...], kernels: Any
) -> dict[str, Any]:
    """SQNR of y, dx, dw against the bf16 grouped GEMM; ``calc_diff`` against the CPU emulation on the
    first ``len(emulated)`` experts with ``emulated`` rows each; an empty expert's zero gradient."""
    x, w, dy = operands
    fp8 = grouped_projection(x, w, dy, counts, kernels)
    bf16 = grouped_projection(x, w, dy, counts, None)
    row: dict[str, Any] = {"bf16 GEMM": bf16[3]}
    for i, name in enumerate(("y", "dx", "dw")):
        row[f"sqnr {name} dB"] = sqnr(bf16[i].float(), fp8[i].float())
    rows, experts = sum(emulated), len(emulated)
    sub = (x[:rows], w[:experts], dy[:rows])
    here = grouped_projection(*sub, list(emulated), kernels)
    cpu_kernels = bind(get_recipe("blockwise"), "cpu")
    cpu = grouped_projection(*(t.cpu() for t in sub), list(emulated), cpu_kernels)
    row["diff vs cpu"] = max(
        calc_diff(a.float().cpu(), b.float()) for a, b in zip(here[:3], cpu[:3], strict=True)
    )
    empty = [e for e, c in enumerate(counts) if not c]
    row["empty expert dw = 0"] = bool(empty) and not fp8[2][empty].any().item()
    row["ok"] = (
        all(row[f"sqnr {n} dB"] >= floor for n, floor in MOE_SQNR_FLOORS.items())
        and row["diff vs cpu"] < MOE_EMULATION_DIFF
        and row["empty expert dw = 0"]
    )
    return row


def _moe_timings(
    shape: MoeShape, counts: list[int], device: torch.device, sizes: Sizes, backends: list[str]
) -> dict[str, Any]:
    """ms and TFLOP/s of one MoE MLP's forward + backward: bf16, then FP8 on each backend (a step is
    17 TFLOP at the DeepSeek-V3 shape: 5 calls, median of 3, so the phase stays near a minute)."""
    sizes = replace(sizes, warmup=1, reps=min(sizes.reps, 3), calls=min(sizes.calls, 5))
    g = torch.Generator(device=device).manual_seed(1)
    s, h, i, e = shape.rows, shape.hidden, shape.inter, shape.experts
    x = torch.randn(s, h, generator=g, device=device).bfloat16().requires_grad_()
    w1 = (torch.randn(e, 2 * i, h, generator=g, device=device) * 0.02).requires_grad_()
    w2 = (torch.randn(e, h, i, generator=g, device=device) * 0.02).requires_grad_()
    w1b, w2b = w1.detach().bfloat16().requires_grad_(), w2.detach().bfloat16().requires_grad_()
    row: dict[str, Any] = {"shape": shape.label, "check": "timing (fwd+bwd, both projections)"}
    bf16 = _guarded(lambda: time_ms(lambda: mlp_step(x, w1b, w2b, counts, None), device, sizes))
    row["bf16 ms"], row["bf16 TFLOP/s"] = bf16, _rate(shape.flops, bf16)
    for backend in backends:
        kernels = bind(get_recipe("blockwise"), device, backend)
        ms = _guarded(lambda: time_ms(lambda: mlp_step(x, w1, w2, counts, kernels), device, sizes))  # noqa: B023
        row[f"{backend} ms"], row[f"{backend} TFLOP/s"] = ms, _rate(shape.flops, ms)
        if isinstance(ms, float) and isinstance(bf16, float):
            row[f"{backend} / bf16"] = bf16 / ms  # > 1: FP8 faster
    return row


def _rate(flops: int, ms: float | str) -> float | str:
    return flops / (ms * 1e-3) / 1e12 if isinstance(ms, float) else ms


def phase_moe(device: torch.device, sizes: Sizes, backends: list[str], entry: dict, rows: list[dict]) -> None:
    """Per MoE shape: correctness first (each projection on each backend: SQNR vs bf16, the CPU
    emulation, an empty expert), then the timings. A failed check marks the phase failed."""
    for shape in sizes.moe:
        counts = routed_counts(shape.rows, shape.experts)
        operands = _moe_operands(shape, device)
        for proj, ops in operands.items():
            for backend in backends:
                kernels = bind(get_recipe("blockwise"), device, backend)
                row: dict[str, Any] = {"shape": shape.label, "check": proj, "backend": backend}
                row.update(_guarded_dict(lambda: _moe_check(ops, counts, sizes.moe_emulated, kernels)))  # noqa: B023
                if not row.get("ok"):
                    entry["status_override"] = "failed"
                rows.append(row)
        del operands
        rows.append(_moe_timings(shape, counts, device, sizes, backends))
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# 6. the training step


def _train_step(model: Any, ids: torch.Tensor, opt: torch.optim.Optimizer, device: torch.device) -> None:
    """One step as the trainer runs it: quantized weights cached for the step, bf16 autocast around the
    forward, the chunked loss (no [tokens, vocab] logits), then AdamW."""
    from infir2.loss import chunk_tokens_for, lm_loss_sum
    from infir2.model import autocast
    from infir2.nn import cache_fp8_weights

    tokens, vocab = ids.numel(), model.config.vocab_size
    with cache_fp8_weights(model):
        with autocast("bf16", device):
            loss = lm_loss_sum(model, ids, ids, chunk_tokens=chunk_tokens_for("auto", tokens, vocab)) / tokens
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _step_arm(spec: StepModel, recipe: str, backend: str | None, device: torch.device, sizes: Sizes) -> dict:
    """Build the model for one arm, one warm-up step, ``sizes.steps`` timed ones; time and peak memory."""
    from infir2.model import build_from_config, prepare_for_training

    model = build_from_config(step_model_config(spec), seed=0, device=device)
    prepare_for_training(model, recipe, backend=backend, recompute_mlp=True)  # fp32 masters, FP8 swap
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    ids = torch.randint(0, spec.vocab, (1, spec.seq), device=device)
    _train_step(model, ids, opt, device)  # compiles the Triton kernels, allocates the AdamW state
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    saved = replace(sizes, warmup=0, reps=sizes.steps, calls=1)
    ms = time_ms(lambda: _train_step(model, ids, opt, device), device, saved)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"step ms": ms, "TFLOP/s": step_flops(spec, spec.seq) / (ms * 1e-3) / 1e12, "peak GiB": peak}


def phase_step(
    device: torch.device, sizes: Sizes, backends: list[str], report: Report, deadline: float, rows: list[dict]
) -> None:
    """BF16 and FP8 (each backend) steps, one arm at a time; the report is written after each arm."""
    spec = sizes.step
    case = f"{spec.layers}-layer Qwen2.5-1.5B shape, seq {spec.seq}"
    base: dict | None = None
    for arm, recipe, backend in [("bf16", "bf16", None), *[(f"fp8[{b}]", "blockwise", b) for b in backends]]:
        if time.monotonic() > deadline:
            rows.append({"case": case, "arm": arm, "error": "skipped: --budget-s spent"})
            continue
        result = _guarded_dict(lambda: _step_arm(spec, recipe, backend, device, sizes))  # noqa: B023
        gc.collect()  # the arm's model and optimizer state, before the next one is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row = {"case": case, "arm": arm, **result}
        if base is None and arm == "bf16" and "error" not in result:
            base = result
        if base is not None and arm != "bf16" and "error" not in result:
            row["time vs bf16"] = result["step ms"] / base["step ms"]  # InfiR2: 0.78x
            if base["peak GiB"]:
                row["memory vs bf16"] = result["peak GiB"] / base["peak GiB"]  # InfiR2: 0.86x
        rows.append(row)
        report.write()


def _guarded_dict(fn: Callable[[], dict]) -> dict:
    try:
        return fn()
    except Exception as e:  # one arm failing leaves the others
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]}


def _vllm_arm(arm: str, device: torch.device, layers: int | None, timeout_s: float) -> dict:
    """One arm of ``vllm_bench.py`` in a process of its own: its JSON line, or why there is none."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vllm_bench.py"), "--arm", arm, "--device", device.type]
    cmd += ["--layers", str(layers)] if layers else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"arm": arm, "error": f"timed out after {timeout_s:g} s (--vllm-timeout)"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    tail = [ln for ln in done.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
    return {"arm": arm, "error": f"exit {done.returncode}: {tail[0][:200]}"}


def phase_vllm(
    device: torch.device, layers: int | None, timeout_s: float, report: Report, rows: list[dict]
) -> None:
    """The vllm engine's rollouts (``vllm_bench.py``: the high-precision arm -- bf16 on CUDA -- and the FP8
    one, each in its own process): tokens/s, refit time per update, the rollout-vs-trainer mismatch; the
    FP8 arm beside the high-precision one."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("vLLM is not installed here (pip install vllm; on a CPU: .ci/vllm-env)")
    base = None
    for arm in ("high", "fp8"):
        row = _vllm_arm(arm, device, layers, timeout_s)
        if arm == "high" and "error" not in row:
            base = row
        if arm == "fp8" and base is not None and "error" not in row:
            row["tokens/s vs high"] = row["rollout tokens/s"] / base["rollout tokens/s"]
            row["refit vs high"] = row["refit s (median)"] / base["refit s (median)"]
        rows.append(row)
        report.write()
    if any("error" in r for r in rows):
        raise RuntimeError("; ".join(f"{r['arm']}: {r['error']}" for r in rows if "error" in r))


# ----------------------------------------------------------------------------------------------
# driver


def _meta(device: torch.device, argv: list[str]) -> dict[str, Any]:
    triton = importlib.util.find_spec("triton") is not None
    transformers = importlib.util.find_spec("transformers") is not None
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["PYTHONPATH=src python3 benchmarks/gpu_bench.py", *argv]),
        "device": device_name(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": __import__("triton").__version__ if triton else None,
        "transformers": __import__("transformers").__version__ if transformers else None,
    }
    if device.type == "cuda":
        meta["capability"] = "SM{}{}".format(*torch.cuda.get_device_capability(device))
        meta["gpus"] = torch.cuda.device_count()
        meta["memory GiB"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return meta


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench-gpu"), help="output folder")
    p.add_argument(
        "--phases",
        default=",".join(DEFAULT_PHASES),
        help=f"comma-separated, of {', '.join(PHASES)} (default: all but vllm)",
    )
    p.add_argument("--vllm-timeout", type=float, default=420.0, help="seconds one vLLM arm may take")
    p.add_argument("--checks-only", action="store_true", help="env and checks only")
    p.add_argument("--skip-checks", action="store_true", help="every phase but the checks")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the step model (default 28)")
    p.add_argument("--budget-s", type=float, default=480.0, help="start no phase (or step arm) after this")
    p.add_argument("--checks-timeout", type=float, default=300.0, help="seconds before pytest is killed")
    p.add_argument(
        "--wheels", type=Path, default=ROOT / "gpu-wheels", help="pytest wheels if none is installed"
    )
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run at tiny shapes")
    return p


def _phases(args: argparse.Namespace) -> list[str]:
    names = [n.strip() for n in args.phases.split(",") if n.strip()]
    bad = [n for n in names if n not in PHASES]
    if bad:
        raise SystemExit(f"--phases: unknown {bad}; expected some of {', '.join(PHASES)}")
    if args.checks_only:
        names = [n for n in names if n in ("env", "checks")]
    if args.skip_checks:
        names = [n for n in names if n != "checks"]
    return names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_bench.py: no CUDA device (--device cpu runs the dry run)", file=sys.stderr)
        return 2
    sizes = GPU if device.type == "cuda" else CPU_DRY_RUN
    if args.layers:
        sizes = replace(sizes, step=replace(sizes.step, layers=args.layers))
    phases = _phases(args)
    blockwise = get_recipe("blockwise")
    backends = [b for b in FP8_BACKENDS if BACKENDS[b].why_unavailable(blockwise, device) is None]
    backends = backends or [bind(blockwise, device).name]  # the CPU dry run: its emulation
    report = Report(args.out, {**_meta(device, argv), "sizes": asdict(sizes), "backends": backends})
    deadline = time.monotonic() + args.budget_s
    jobs: dict[str, Callable[[list[dict]], None]] = {
        "env": lambda rows: phase_env(device, rows),
        "checks": lambda rows: phase_checks(
            args.out, args.wheels, args.checks_timeout, report.phase("checks"), rows
        ),
        "gemm": lambda rows: phase_gemm(device, sizes, backends, rows),
        "quantize": lambda rows: phase_quantize(device, sizes, backends, rows),
        "moe": lambda rows: phase_moe(device, sizes, backends, report.phase("moe"), rows),
        "step": lambda rows: phase_step(device, sizes, backends, report, deadline, rows),
        "vllm": lambda rows: phase_vllm(device, args.layers, args.vllm_timeout, report, rows),
    }
    print(json.dumps(report.data["meta"]), flush=True)
    for name in phases:
        if time.monotonic() > deadline and name != "env":
            report.phase(name).update(status="skipped", error="--budget-s spent before it started")
            report.write()
            continue
        run_phase(report, name, jobs[name])
    print(render(report.data), flush=True)
    return 0 if all(e["status"] == "ok" for e in report.data["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
