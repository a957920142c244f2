"""The experts' grouped GEMM: blockwise FP8 (``infir2.nn.moe.fp8_grouped_linear``) vs the bf16 grouped GEMM.

Per shape (hidden H, expert width I, experts E, S routed rows): one MoE MLP's two grouped
projections (gate_up ``[S, H] -> [S, 2I]``, down ``[S, I] -> [S, H]``, rows routed at random,
uneven) forward + backward (``infir2.tools.bench.moe.mlp_step``), fastest of ``--repeats``, and the
bytes each keeps for backward (FP8: the 128x1-tiled wgrad copy of its input, codes + scales; bf16:
the input itself). Shapes: small ones on a CPU (the exact emulation); on a GPU
``infir2.tools.bench.moe.MOE_GPU_SHAPES`` (DeepSeek-V3 7168 / 2048, a GPU's 32 of 256 experts;
Qwen3-30B-A3B 2048 / 768, 128 experts; 65536 rows each), where the FP8 path is the per-expert loop
of the dense kernels (``infir2.kernels.grouped``) -- not yet run on one. ``benchmarks/gpu_bench.py``
checks the same shapes (SQNR, the CPU emulation) before it times them.

Run: ``nice python benchmarks/moe_grouped.py [--repeats 3] [--device cpu|cuda]``
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import datetime, timezone

import torch

from infir2.fp8 import get_recipe
from infir2.kernels import bind
from infir2.tools.bench.moe import MOE_GPU_SHAPES, MoeShape, mlp_step, routed_counts

CPU_SHAPES = (MoeShape("tiny", 256, 128, 8, 2048), MoeShape("small", 512, 256, 16, 8192))


def _fastest(fn, repeats: int, device: str) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def bench(shape: MoeShape, repeats: int, device: str) -> str:
    h, i, e, rows = shape.hidden, shape.inter, shape.experts, shape.rows
    counts = routed_counts(rows, e, empty=False)
    kernels = bind(get_recipe("blockwise"), device)
    torch.manual_seed(0)
    x = torch.randn(rows, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(e, 2 * i, h, device=device) * 0.02).requires_grad_()
    w2 = (torch.randn(e, h, i, device=device) * 0.02).requires_grad_()
    w1b, w2b = w1.detach().bfloat16().requires_grad_(), w2.detach().bfloat16().requires_grad_()
    fp8_ms = _fastest(lambda: mlp_step(x, w1, w2, counts, kernels), repeats, device)
    bf16_ms = _fastest(lambda: mlp_step(x, w1b, w2b, counts, None), repeats, device)
    saved_bf16 = 2 * rows * (h + i)  # the two inputs, bf16
    tiles = sum(-(-c // 128) for c in counts if c)
    saved_fp8 = rows * (h + i) + 4 * tiles * (h + i)  # codes + one fp32 scale per 128 rows per channel
    return (
        f"{shape.label:<16} H={h:<5} I={i:<5} E={e:<4} rows={rows:<6} "
        f"fp8 {fp8_ms:9.1f} ms  bf16 {bf16_ms:9.1f} ms  ratio {fp8_ms / bf16_ms:5.2f}  "
        f"saved fp8/bf16 {saved_fp8 / saved_bf16:.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = MOE_GPU_SHAPES if args.device == "cuda" else CPU_SHAPES
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    print(
        f"moe_grouped  {stamp}  {platform.machine()}  torch {torch.__version__}  {args.device}  "
        f"threads {args.threads}  fastest of {args.repeats}"
    )
    for shape in shapes:
        print(bench(shape, args.repeats, args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
