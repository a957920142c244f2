"""The experts' grouped GEMM: blockwise FP8 (``infir2.nn.moe.fp8_grouped_linear``) vs the bf16 grouped GEMM.

Per shape (hidden H, expert width I, experts E, top-k, tokens T): one MoE MLP's two grouped
projections (gate_up ``[S, H] -> [S, 2I]``, down ``[S, I] -> [S, H]``, S = T * k rows routed at
random, uneven) forward + backward, fastest of ``--repeats``, and the bytes each keeps for backward
(FP8: the 128x1-tiled wgrad copy of its input, codes + scales; bf16: the input itself). Shapes: small
ones on a CPU (the exact emulation); DeepSeek-V3 (7168 / 2048, 256 experts, top-8) and Qwen3-30B-A3B
(2048 / 768, 128 experts, top-8) on a GPU, where the FP8 path is the per-expert loop of the dense
kernels (``infir2.kernels.grouped``) -- not yet run on one.

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
from infir2.nn.moe import fp8_grouped_linear

# label -> (hidden, expert width, experts, top-k, tokens)
CPU_SHAPES = {"tiny": (256, 128, 8, 2, 1024), "small": (512, 256, 16, 4, 2048)}
GPU_SHAPES = {"deepseek-v3": (7168, 2048, 256, 8, 8192), "qwen3-30b-a3b": (2048, 768, 128, 8, 8192)}


def _counts(rows: int, experts: int, seed: int = 0) -> list[int]:
    """Uneven rows per expert (a random routing), some experts possibly empty."""
    ids = torch.randint(0, experts, (rows,), generator=torch.Generator().manual_seed(seed))
    return torch.bincount(ids, minlength=experts).tolist()


def _fp8_step(x, w1, w2, counts, recipe, kernels):  # type: ignore[no-untyped-def]
    h = fp8_grouped_linear(x, w1, counts, recipe, kernels)
    y = fp8_grouped_linear(h[:, : w2.shape[2]], w2, counts, recipe, kernels)
    y.float().sum().backward()


def _bf16_step(x, w1, w2, counts):  # type: ignore[no-untyped-def]
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    h = torch.nn.functional.grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    y = torch.nn.functional.grouped_mm(h[:, : w2.shape[2]].contiguous(), w2.transpose(-2, -1), offs=offs)
    y.float().sum().backward()


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


def bench(label: str, shape: tuple[int, int, int, int, int], repeats: int, device: str) -> str:
    h, i, e, k, t = shape
    rows = t * k
    counts = _counts(rows, e)
    recipe = get_recipe("blockwise")
    kernels = bind(recipe, device)
    torch.manual_seed(0)
    x = torch.randn(rows, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(e, 2 * i, h, device=device) * 0.02).requires_grad_()
    w2 = (torch.randn(e, h, i, device=device) * 0.02).requires_grad_()
    w1b, w2b = w1.detach().bfloat16().requires_grad_(), w2.detach().bfloat16().requires_grad_()
    fp8_ms = _fastest(lambda: _fp8_step(x, w1, w2, counts, recipe, kernels), repeats, device)
    bf16_ms = _fastest(lambda: _bf16_step(x, w1b, w2b, counts), repeats, device)
    saved_bf16 = 2 * rows * (h + i)  # the two inputs, bf16
    tiles = sum(-(-c // 128) for c in counts if c)
    saved_fp8 = rows * (h + i) + 4 * tiles * (h + i)  # codes + one fp32 scale per 128 rows per channel
    return (
        f"{label:<14} H={h:<5} I={i:<5} E={e:<4} k={k} rows={rows:<6} "
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
    shapes = GPU_SHAPES if args.device == "cuda" else CPU_SHAPES
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    print(
        f"moe_grouped  {stamp}  {platform.machine()}  torch {torch.__version__}  {args.device}  "
        f"threads {args.threads}  fastest of {args.repeats}"
    )
    for label, shape in shapes.items():
        print(bench(label, shape, args.repeats, args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
