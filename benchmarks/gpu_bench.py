"""GPU check + benchmark of the FP8 fast path, in one process (needs only infir2, torch and triton).

1. Correctness on the GPU (what the CPU test suite cannot check):
   - the Triton quantization kernels (single and fused two-tiling) against ``infir2.fp8.quantize``, bit for bit (FP8 data with NaNs
     compared as NaN, and ``scale_inv``), for 1x128, 128x1 and 128x128 blocks, pow2 and fp32 scales,
     fp32 and bf16 inputs, partial edge blocks, zeros, outliers, tiny values, NaN and +-inf;
   - the block-scaled GEMMs of the ``cuda`` (cuBLAS ``scaled_mm``, Triton where cuBLAS cannot) and
     ``triton`` backends against the emulated backend, ``calc_diff < 1e-3``, for fprop, dgrad, wgrad;
   - an ``Fp8Linear`` forward + backward on each backend against the emulated backend;
   - no host synchronization inside an ``Fp8Linear`` step (``torch.cuda.set_sync_debug_mode("error")``).
2. ``infir2 bench`` (preset ``full``): BF16 ``nn.Linear`` vs ``Fp8Linear`` at the Qwen2.5-1.5B and 7B
   layer GEMMs, quantization GB/s vs a device-to-device copy, and a Qwen2.5-1.5B training step at 8k.

Run on an H100/H200 (about 5-8 minutes):

    python benchmarks/gpu_bench.py --out bench-gpu            # everything
    python benchmarks/gpu_bench.py --out bench-gpu --layers 8 --iters 5   # shorter step section

Writes ``<out>/gpu_bench.json`` (checks + benchmark rows) and ``<out>/gpu_bench.txt`` (the table).
The exit status is 1 when a correctness check fails (the benchmark still runs and is written).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from infir2.bench import PRESETS, main_table, run_bench
from infir2.fp8 import calc_diff, quantize
from infir2.kernels import BACKENDS, Operand, emulated

#: Shapes of the checks (module constants so a CPU smoke run under TRITON_INTERPRET=1 can shrink them).
QUANT_SHAPES: tuple[tuple[int, int], ...] = ((4096, 1536), (1000, 1100), (5, 130))
GEMM_SHAPES: tuple[tuple[int, int, int], ...] = (
    (8192, 1536, 1536),
    (8192, 256, 1536),
    (4096, 8960, 1536),
    (1000, 384, 520),
)
LINEAR_SHAPE: tuple[int, int, int, int] = (4, 2048, 1536, 8960)  # batch, seq, in, out


def _hard_input(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 3
    x[0, 0], x[1, 3], x[-1, -1] = float("nan"), float("inf"), float("-inf")
    x[2] = 0.0
    x[:, 5] *= 1e4
    x[-2, :40] = 1e-30
    return x.to(device=device, dtype=dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.float().isnan() & b.float().isnan()
    return bool(((a.view(torch.uint8) == b.view(torch.uint8)) | nan).all())


def check_quantize(device: torch.device) -> list[dict[str, Any]]:
    from infir2.kernels import triton_quant

    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in QUANT_SHAPES:
            x = _hard_input(shape, dtype, device)
            for block in ((1, 128), (128, 1), (128, 128)):
                for pow2 in (True, False):
                    for fmt in ("e4m3", "e5m2"):
                        data, scale_inv = triton_quant.quantize(x, block, fmt, pow2)
                        ref_data, ref_scale_inv = quantize(x, block, fmt, pow2)
                        ok = torch.equal(scale_inv, ref_scale_inv) and _same_bits(data, ref_data)
                        results.append({"check": "quantize bit-exact", "dtype": str(dtype), "shape": shape,
                                        "block": block, "pow2": pow2, "fmt": fmt, "ok": ok})  # fmt: skip
            for pow2 in (True, False):  # the fused kernel: both activation tilings from one read
                pair = triton_quant.quantize_both(x, "e4m3", pow2)
                for (data, scale_inv), block in zip(pair, ((1, 128), (128, 1)), strict=True):
                    ref_data, ref_scale_inv = quantize(x, block, "e4m3", pow2)
                    ok = torch.equal(scale_inv, ref_scale_inv) and _same_bits(data, ref_data)
                    results.append({"check": "quantize_both bit-exact", "dtype": str(dtype), "shape": shape,
                                    "block": block, "pow2": pow2, "ok": ok})  # fmt: skip
    return results


def _gemm_operands(m: int, n: int, k: int, device: torch.device) -> dict[str, tuple[Operand, Operand]]:
    g = torch.Generator().manual_seed(m + n + k)
    x, w, dy = (torch.randn(s, generator=g).to(device) for s in ((m, k), (n, k), (m, n)))
    q = BACKENDS["cuda"].quantize
    wq = q(w, (128, 128), "e4m3", True)
    return {
        "fprop": (q(x, (1, 128), "e4m3", True), wq),
        "dgrad": (q(dy, (1, 128), "e4m3", True), wq.t()),
        "wgrad": (q(dy, (128, 1), "e4m3", True).t(), q(x, (128, 1), "e4m3", True).t()),
    }


def check_gemm(device: torch.device) -> list[dict[str, Any]]:
    results = []
    for m, n, k in GEMM_SHAPES:
        for name, (a, b) in _gemm_operands(m, n, k, device).items():
            ref = emulated.gemm_nt(a, b, torch.float32)
            for backend in ("cuda", "triton"):
                for out_dtype in (torch.float32, torch.bfloat16):
                    out = BACKENDS[backend].gemm_nt(a, b, out_dtype)
                    diff = calc_diff(out.float(), ref)
                    results.append({"check": "gemm calc_diff", "gemm": name, "mnk": (m, n, k), "backend": backend,
                                    "out_dtype": str(out_dtype), "calc_diff": diff, "ok": diff < 1e-3})  # fmt: skip
    return results


def check_linear_and_syncs(device: torch.device) -> list[dict[str, Any]]:
    from infir2.nn import Fp8Linear, cache_fp8_weights

    results = []
    torch.manual_seed(0)
    b, s, k, n = LINEAR_SHAPE
    x = torch.randn(b, s, k, device=device, dtype=torch.bfloat16)
    dy = torch.randn(b, s, n, device=device, dtype=torch.bfloat16)
    outs = {}
    for backend in ("emulated", "cuda", "triton"):
        layer = Fp8Linear(k, n, bias=False, device=device, dtype=torch.bfloat16, backend=backend)
        torch.manual_seed(1)
        torch.nn.init.normal_(layer.weight, std=0.02)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        outs[backend] = (y, xi.grad, layer.weight.grad)
        if backend != "emulated":
            diffs = [
                calc_diff(a.float(), b.float()) for a, b in zip(outs["emulated"], outs[backend], strict=True)
            ]
            results.append({"check": "Fp8Linear vs emulated", "backend": backend, "calc_diff": diffs,
                             "ok": max(diffs) < 1e-3})  # fmt: skip
            torch.cuda.synchronize()
            try:  # a host sync inside the step raises here
                torch.cuda.set_sync_debug_mode("error")
                with cache_fp8_weights(layer):
                    layer(xi).backward(dy)
                ok, why = True, "no host sync"
            except RuntimeError as e:
                ok, why = False, str(e).splitlines()[0]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            results.append(
                {"check": "no host sync in Fp8Linear step", "backend": backend, "ok": ok, "detail": why}
            )
    return results


def run_checks(device: torch.device) -> list[dict[str, Any]]:
    results = []
    for check in (check_quantize, check_gemm, check_linear_and_syncs):
        t0 = time.perf_counter()
        try:
            found = check(device)
        except Exception as e:  # report and keep going: the benchmark still runs
            found = [
                {"check": check.__name__, "ok": False, "error": repr(e), "trace": traceback.format_exc()}
            ]
        failed = [r for r in found if not r["ok"]]
        print(
            f"{check.__name__}: {len(found) - len(failed)}/{len(found)} ok ({time.perf_counter() - t0:.1f} s)"
        )
        for r in failed[:10]:
            print("  FAILED", {k: v for k, v in r.items() if k != "trace"})
        results += found
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench-gpu"), help="output folder")
    parser.add_argument(
        "--layers", type=int, default=None, help="decoder layers of the step model (default 28)"
    )
    parser.add_argument("--tokens", type=int, default=None, help="tokens per linear GEMM (default 8192)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default 10)")
    parser.add_argument("--skip-checks", action="store_true", help="benchmark only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    import triton

    print(f"{torch.cuda.get_device_name()}  SM{''.join(map(str, torch.cuda.get_device_capability()))}  "
          f"torch {torch.__version__}  CUDA {torch.version.cuda}  triton {triton.__version__}")  # fmt: skip
    checks = [] if args.skip_checks else run_checks(device)
    cfg = PRESETS["full"]
    if args.tokens:
        cfg = replace(cfg, tokens=args.tokens)
    if args.iters:
        cfg = replace(cfg, iters=args.iters)
    if args.layers and cfg.step is not None:
        cfg = replace(cfg, step=replace(cfg.step, layers=args.layers))
    result = run_bench(cfg, device, ["cuda", "triton"], ["quantize", "linear", "step"])
    result["checks"] = checks
    result["meta"]["command"] = " ".join(["python", "benchmarks/gpu_bench.py", *(argv or sys.argv[1:])])
    args.out.mkdir(parents=True, exist_ok=True)
    table = main_table(result)
    (args.out / "gpu_bench.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out / "gpu_bench.txt").write_text(table + "\n")
    n_failed = sum(not r["ok"] for r in checks)
    print(f"checks: {len(checks) - n_failed}/{len(checks)} ok")
    print(table)
    return 1 if n_failed else 0


if __name__ == "__main__":
    sys.exit(main())
