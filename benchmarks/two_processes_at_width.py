"""2 processes (FSDP2, gloo) against 1 process at the Qwen2.5-0.5B width, with clipping on every step.

Runs ``tests/two_process_exact_worker.py`` (two micro-batches a step: one per rank, or both in one
process) for each recipe at hidden ``--width`` (default 896, 14 / 2 heads, MLP 4864, vocabulary 4096,
``--layers`` decoder layers), then the same steps in one process, and prints per step the loss and
gradient norm of both and whether the final weights are bit-identical. The float64 gradient norm
(``harness.guards.grad_norm``) is what makes them so: with torch's fp32 norm the clip factor depended
on the sharding. Prints the CPU (lscpu) first.

    python benchmarks/two_processes_at_width.py --width 896 --layers 2 --steps 3 --recipes bf16,blockwise
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from infir2.tools.machine import cpu_description

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=896, help="hidden size (default: Qwen2.5-0.5B's 896)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    p.add_argument("--recipes", default="bf16,blockwise", help="comma-separated (default bf16,blockwise)")
    args = p.parse_args()
    from infir2.checkpoint import load_checkpoint
    from infir2.train import train
    from train_synthetic import SyntheticSource, torchrun
    from two_process_exact_worker import SOURCE, model, run_config

    torch.set_num_threads(1)
    recipes = args.recipes.split(",")
    print(
        f"CPU: {cpu_description()}; torch {torch.__version__}; width {args.width}, {args.layers} layers, {args.steps} steps"
    )
    with tempfile.TemporaryDirectory() as tmp:
        shape = ["--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps)]
        torchrun(ROOT / "tests" / "two_process_exact_worker.py", tmp, *recipes, *shape, timeout=1800)
        for recipe in recipes:
            one = train(
                run_config(str(Path(tmp) / "one"), recipe, args.steps),
                model=model(args.width, args.layers),
                train_source=SyntheticSource(vocab_size=4096, **SOURCE),
                progress=False,
            )
            two_dir = Path(tmp) / f"two-{recipe}"
            two = [json.loads(x) for x in (two_dir / "metrics.jsonl").read_text().splitlines()]
            for a, b in zip(one.history, two, strict=True):
                same = (
                    "identical" if a["loss"] == b["loss"] else f"differ by {abs(a['loss'] - b['loss']):.3g}"
                )
                print(
                    f"{recipe} step {a['step']}: loss {a['loss']:.6f} (1 process) vs {b['loss']:.6f} (2): {same}; "
                    f"grad norm {a['grad_norm']:.9g} vs {b['grad_norm']:.9g}"
                )
            wa = load_checkpoint(one.checkpoint)["model"]
            wb = load_checkpoint(two_dir / "checkpoints" / f"step_{args.steps:08d}")["model"]
            off = [k for k in wa if not torch.equal(wa[k], wb[k])]
            print(
                f"{recipe}: final weights {'bit-identical' if not off else f'differ in {len(off)} tensors'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
