"""`infir2 eval` throughput: the builtin engine (the KV-cache engine in this process, batched) vs the server engine through `transformers serve`.

    python benchmarks/eval_server.py --out /tmp/eval-bench [--hidden 256] [--n 4] [--max-new-tokens 64] [--cb]

Exports a tiny Qwen2 (FP8 layout), then evaluates the shipped math sample (8 problems x --n samples,
sampling at 0.65 / 0.95, every sample running to --max-new-tokens unless it stops) twice into fresh
folders: `--engine builtin --batch-size 8`, and `--engine server --concurrency 8` against
`transformers serve` on the same CPU (started by the script on a free local port; `--cb` turns on its
continuous batching), each with --threads torch threads. Prints generated tokens per second of each (from summary.json:
new tokens / generation seconds; the server's start-up is reported apart) and the ratio. On a CPU with a
tiny model this measures the HTTP path and the server's scheduling, not a GPU engine's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny model, tokenizer and server helpers of the test suite

from conftest import make_tiny_model, make_tokenizer  # noqa: E402
from infir2.cli import main  # noqa: E402
from infir2.export import export_model  # noqa: E402
from transformers_server import transformers_serve  # noqa: E402


def _run(argv: list[str], out: Path) -> dict:
    if main([*argv, "--out", str(out)]) != 0:
        raise SystemExit(f"infir2 {' '.join(argv)} failed")
    return json.loads((out / "summary.json").read_text())


def main_(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)  # the builtin engine; the server gets OMP_NUM_THREADS below
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    folder = export_model(
        make_tiny_model(hidden=args.hidden),
        make_tokenizer(),
        out / "fp8",
        fmt="fp8",
        base_dtype=torch.bfloat16,
    )
    AutoTokenizer.from_pretrained(folder).save_pretrained(folder)  # as transformers serve reads it
    common = [
        "eval",
        "--model",
        str(folder),
        "--n",
        str(args.n),
        "--max-new-tokens",
        str(args.max_new_tokens),
    ]
    builtin = _run([*common, "--batch-size", "8"], out / "builtin")
    start = time.perf_counter()
    with transformers_serve(
        folder, out / "serve.log", extra=["--continuous-batching"] if args.cb else []
    ) as s:
        startup = time.perf_counter() - start
        server = _run(
            [*common, "--engine", "server", "--base-url", s.url, "--concurrency", "8"], out / "server"
        )
    rows = [("builtin (batch 8)", builtin), (f"server (concurrency 8{', cb' if args.cb else ''})", server)]
    print(f"\n{'engine':<32} {'samples':>7} {'tokens':>7} {'seconds':>8} {'tok/s':>7}")
    for name, s in rows:
        tokens = round(s["mean_new_tokens"] * s["samples"])
        print(
            f"{name:<32} {s['samples']:>7} {tokens:>7} {s['seconds']:>8.2f} {s['new_tokens_per_second']:>7.1f}"
        )
    ratio = server["new_tokens_per_second"] / builtin["new_tokens_per_second"]
    print(f"server / builtin throughput: {ratio:.2f}x (server start-up {startup:.1f} s, not counted)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/infir2-eval-bench")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of each engine (on a shared 2-core machine, 2 threads made batched "
        "generation 20x slower from OpenMP contention)",
    )
    p.add_argument("--cb", action="store_true", help="transformers serve --continuous-batching")
    main_(p.parse_args())
