"""GPU benchmark of the FP8 fast path: ``infir2 bench`` (preset ``full``) on a CUDA GPU.

BF16 ``nn.Linear`` vs ``Fp8Linear`` at the Qwen2.5-1.5B and 7B layer GEMMs, quantization GB/s vs a
device-to-device copy, and a Qwen2.5-1.5B training step at 8k, for the ``scaled_mm`` (cuBLAS) and
``triton`` backends. Correctness comes first and lives in the test suite: ``tests/gpu/`` (skipped
on machines without the GPU it needs). On an H100/H200, about 5-8 minutes in all::

    python -m pytest tests/gpu -q && python benchmarks/gpu_bench.py --out bench-gpu
    python benchmarks/gpu_bench.py --out bench-gpu --layers 8 --iters 5   # shorter step section

Writes ``<out>/gpu_bench.json`` (benchmark rows) and ``<out>/gpu_bench.txt`` (the table).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from infir2.tools.bench import PRESETS, main_table, run_bench


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
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    import triton

    print(f"{torch.cuda.get_device_name()}  SM{''.join(map(str, torch.cuda.get_device_capability()))}  "
          f"torch {torch.__version__}  CUDA {torch.version.cuda}  triton {triton.__version__}")  # fmt: skip
    cfg = PRESETS["full"]
    if args.tokens:
        cfg = replace(cfg, tokens=args.tokens)
    if args.iters:
        cfg = replace(cfg, iters=args.iters)
    if args.layers and cfg.step is not None:
        cfg = replace(cfg, step=replace(cfg.step, layers=args.layers))
    result = run_bench(cfg, device, ["scaled_mm", "triton"], ["quantize", "linear", "step"])
    result["meta"]["command"] = " ".join(["python", "benchmarks/gpu_bench.py", *(argv or sys.argv[1:])])
    args.out.mkdir(parents=True, exist_ok=True)
    table = main_table(result)
    (args.out / "gpu_bench.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out / "gpu_bench.txt").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
