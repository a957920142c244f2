"""Tiny CPT run, AdamW moments in fp32 vs bf16 (``optim.state_dtype``), two seeds each.

The model is the tests' tiny Qwen2 (2 layers, hidden 128, vocab 300; ``tests/conftest.py``), the data
the tests' synthetic arithmetic-progression source (``tests/train_synthetic.py``), the FP8 recipe
blockwise, fp32 high precision (CPU). Prints each run's final loss and mean loss over the last 10
steps, and whether the bf16-moment runs land within the fp32 runs' seed spread.

    PYTHONPATH=src python benchmarks/optim_state_dtype.py --steps 60
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_tiny_model
from infir2.train import train
from train_synthetic import SyntheticSource, tiny_run_config

LAST = 10


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", default="0,1")
    args = p.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[tuple[str, int], tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as out:
        for dtype in ("fp32", "bf16"):
            for seed in seeds:
                cfg = tiny_run_config(
                    out,
                    f"{dtype}-{seed}",
                    run={"seed": seed},
                    optim={"lr": 3e-3, "state_dtype": dtype},
                    train={"max_steps": args.steps},
                )
                r = train(
                    cfg,
                    model=make_tiny_model(seed=seed),
                    train_source=SyntheticSource(seed=seed),
                    progress=False,
                )
                losses = [m["loss"] for m in r.history]
                results[dtype, seed] = (losses[-1], sum(losses[-LAST:]) / LAST)
    print(f"tiny CPT, {args.steps} steps, blockwise FP8; loss: final | mean of last {LAST}")
    for (dtype, seed), (final, mean) in results.items():
        print(f"  moments {dtype:<5} seed {seed}: {final:.4f} | {mean:.4f}")
    fp32 = [results["fp32", s][1] for s in seeds]
    bf16 = [results["bf16", s][1] for s in seeds]
    spread = max(fp32) - min(fp32)
    gap = abs(sum(bf16) / len(bf16) - sum(fp32) / len(fp32))
    print(
        f"fp32 seed spread (last-{LAST} mean) {spread:.4f}; |mean bf16 - mean fp32| {gap:.4f}; "
        f"within spread: {gap <= spread}"
    )


if __name__ == "__main__":
    main()
