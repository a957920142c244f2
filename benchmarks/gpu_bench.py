"""The first thing to run on a CUDA GPU: correctness checks, then the FP8 fast path's timings.

One call, estimated at 3-5 minutes on an H100 / H200 (not timed yet: every phase prints its own
elapsed time)::

    python benchmarks/gpu_bench.py --out bench-gpu

1. checks  - ``pytest tests/gpu`` in a subprocess (its pass / fail / skip lines are printed as they
             come): the Triton quantization bit for bit against the reference (every special value,
             E5M2 +-inf included), offsets past 2**31 (a ``[131072, 18944]`` bf16 quantize and a
             2.5e9-element GEMM output, last blocks against the reference), the cuBLAS and Triton
             block-scaled GEMMs against the emulated one, ``Fp8Linear`` on every GPU backend, a layer
             on ``cuda:1`` (skipped with one GPU), no host sync in a step, and a world-size-1 NCCL
             FSDP2 run with FP8 all-gather and fused AdamW under ``TORCH_CUDA_SANITIZER=1``.
             A failure is reported and the timings still run (``--checks-only`` stops here).
2. dgrad   - the dgrad GEMM ``dY @ W`` with the FP8 weight as the transposed view ``Q(W).T`` against
             the K-major copy that ``cache_fp8_weights`` keeps per step (and the copy's own cost),
             per backend, at the Qwen2.5-1.5B / 7B MLP shapes.
3. bench   - ``infir2 bench --preset full`` on ``scaled_mm`` (cuBLAS) and ``triton``: BF16 ``nn.Linear``
             vs ``Fp8Linear`` at the 1.5B / 7B layer GEMMs (8192 tokens), quantization GB/s against a
             device-to-device copy, and a Qwen2.5-1.5B-shaped training step at 8k (8 layers by
             default; ``--layers 28`` for the whole model, about 2 minutes more).

Writes ``<out>/checks.txt`` (the pytest output), ``<out>/gpu_bench.json`` (benchmark rows) and
``<out>/gpu_bench.txt`` (the tables). Exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from infir2.fp8 import get_recipe
from infir2.fp8.recipe import Cast
from infir2.kernels import BACKENDS, Operand, emulated
from infir2.tools.bench import PRESETS, main_table, run_bench

ROOT = Path(__file__).resolve().parents[1]
#: dgrad shapes (tokens, N = out_features, K = in_features): dX [T, K] = dY [T, N] @ W [N, K]
DGRAD_SHAPES = {
    "1.5B up/gate": (8192, 8960, 1536),
    "1.5B down": (8192, 1536, 8960),
    "7B up/gate": (8192, 18944, 3584),
    "7B down": (8192, 3584, 18944),
}


def run_checks(out: Path) -> bool:
    """``pytest tests/gpu`` in a subprocess, its output streamed and saved; True when nothing failed."""
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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    lines = []
    with subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as p:
        assert p.stdout is not None
        for line in p.stdout:
            print("  " + line, end="", flush=True)
            lines.append(line)
    (out / "checks.txt").write_text("".join(lines))
    return p.returncode == 0


def _time_ms(fn, iters: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median time of ``fn`` in ms after 3 warm-up calls (CUDA events when a GPU is there)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if not torch.cuda.is_available():  # a CPU smoke run of this script's code paths
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


DGRAD_HEADER = f"{'dgrad shape':<14} {'backend':<10} {'view ms':>8} {'K-major ms':>11} {'ratio':>6} {'copy ms':>8} {'max |diff|':>10}"


def _dgrad_line(r: dict) -> str:
    return (
        f"{r['shape']:<14} {r['backend']:<10} {r['view_ms']:>8.3f} {r['k_major_ms']:>11.3f} {r['ratio']:>6.2f} "
        f"{r['copy_ms']:>8.3f} {r['max_abs_diff']:>10.2e}"
    )


def bench_dgrad(backends: list[str]) -> list[dict]:
    """dgrad with the transposed-view weight vs the K-major copy; one row per backend and shape."""
    print("  " + DGRAD_HEADER)
    rows = []
    for label, shape in DGRAD_SHAPES.items():
        rows += _dgrad_rows(label, *shape, backends)
        torch.cuda.empty_cache()
    return rows


def _dgrad_rows(label: str, t: int, n: int, k: int, backends: list[str], device: str = "cuda") -> list[dict]:
    dyq = emulated.quantize(torch.randn(t, n, device=device, dtype=torch.bfloat16), Cast((1, 128)))
    view = emulated.quantize(torch.randn(n, k, device=device) * 0.02, Cast((128, 128))).t()  # [K, N] view

    def k_major() -> Operand:  # what Fp8Linear.dgrad_weight keeps per step
        return Operand(view.data.contiguous(), view.scale_inv.contiguous(), view.block)

    copy = k_major()
    rows = []
    for name in backends:
        backend = BACKENDS[name]
        if not backend.supports_gemm(dyq, view, torch.bfloat16):
            continue
        t_view = _time_ms(lambda: backend.gemm_nt(dyq, view, torch.bfloat16))  # noqa: B023
        t_k_major = _time_ms(lambda: backend.gemm_nt(dyq, copy, torch.bfloat16))  # noqa: B023
        diff = backend.gemm_nt(dyq, view, torch.float32) - backend.gemm_nt(dyq, copy, torch.float32)
        row = {
            "shape": label,
            "backend": name,
            "view_ms": t_view,
            "k_major_ms": t_k_major,
            "ratio": t_k_major / t_view,
            "copy_ms": _time_ms(k_major),
            "max_abs_diff": float(diff.abs().max()),
        }
        print("  " + _dgrad_line(row), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench-gpu"), help="output folder")
    parser.add_argument(
        "--layers", type=int, default=8, help="decoder layers of the step model (28: the whole 1.5B)"
    )
    parser.add_argument("--tokens", type=int, default=None, help="tokens per linear GEMM (default 8192)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations of the bench section")
    parser.add_argument("--checks-only", action="store_true", help="run the correctness checks only")
    parser.add_argument("--skip-checks", action="store_true", help="timings only (the checks passed before)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    print(
        f"{torch.cuda.get_device_name()}  SM{''.join(map(str, torch.cuda.get_device_capability()))}  "
        f"{torch.cuda.device_count()} GPU(s)  torch {torch.__version__}  CUDA {torch.version.cuda}  "
        f"triton {triton.__version__}",
        flush=True,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    ok = True
    if not args.skip_checks:
        print("== 1. checks: pytest tests/gpu", flush=True)
        ok = run_checks(args.out)
        print(f"== checks {'PASSED' if ok else 'FAILED'} ({time.perf_counter() - started:.0f} s)", flush=True)
        if args.checks_only:
            return 0 if ok else 1
    blockwise = get_recipe("blockwise")
    backends = [
        b
        for b in ("scaled_mm", "triton")
        if BACKENDS[b].why_unavailable(blockwise, torch.device("cuda")) is None
    ]
    print(f"== 2. dgrad: transposed view vs K-major FP8 weight ({', '.join(backends)})", flush=True)
    dgrad_rows = bench_dgrad(backends)
    print(f"== dgrad done ({time.perf_counter() - started:.0f} s)", flush=True)
    print("== 3. bench: quantize, linear, step", flush=True)
    cfg = replace(PRESETS["full"], iters=args.iters)
    if args.tokens:
        cfg = replace(cfg, tokens=args.tokens)
    if cfg.step is not None:
        cfg = replace(cfg, step=replace(cfg.step, layers=args.layers))
    result = run_bench(cfg, torch.device("cuda"), backends, ["quantize", "linear", "step"])
    result["dgrad"] = dgrad_rows
    result["meta"]["command"] = " ".join(["python", "benchmarks/gpu_bench.py", *(argv or sys.argv[1:])])
    result["meta"]["checks_passed"] = ok if not args.skip_checks else None
    table = main_table(result) + "\n\n" + "\n".join([DGRAD_HEADER, *map(_dgrad_line, dgrad_rows)])
    (args.out / "gpu_bench.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out / "gpu_bench.txt").write_text(table + "\n")
    print(table)
    print(f"== all done in {time.perf_counter() - started:.0f} s; checks {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
