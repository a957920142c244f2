"""A tiny MoE CPT on CPU: held-out loss of FP8 (blockwise) vs the baseline, paired by seed, the null control beside it.

The shipped ``tiny-moe-cpt`` config (a 2-layer Qwen3-MoE, 8 experts, top-2: routed experts in FP8
through ``infir2.nn.Fp8Experts``) on the demo's arithmetic corpus, shortened to fit a shared CPU:
``--steps`` steps at ``--seq-len`` tokens, for ``bf16`` (the baseline), ``blockwise`` and
``fp8_exact`` (the null control: the FP8 code path with exact casts, so its gap is the noise floor)
and ``--seeds`` seeds. Per recipe: the final held-out loss per seed, the paired gap to the baseline
(%), and the verdict of ``infir2.tools.paired`` (95% t-interval against a +-1% margin).

Run: ``nice python benchmarks/moe_cpt.py [--steps 30 --seeds 3 --first-seed 0]`` (about 2 minutes on one core;
``--steps 120 --seeds 8``: about 9 minutes, BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from infir2.cli import main as cli
from infir2.tools.machine import machine_description
from infir2.tools.paired import paired_gaps, paired_verdict
from infir2.train import train
from infir2.train.config import load_config

RECIPES = ("bf16", "blockwise", "fp8_exact")
MARGIN_PCT = 1.0


def run_one(root: Path, recipe: str, seed: int, steps: int, seq_len: int) -> float:
    overrides = [
        f"run.name=moe-{recipe}-{seed}",
        f"run.out_dir={root / 'runs'}",
        f"run.seed={seed}",
        "run.device=cpu",
        f"fp8.recipe={recipe}",
        f"model.tokenizer={root / 'runs/tiny/tokenizer'}",
        f"data.train_path={root / 'runs/tiny/cpt_tokens'}",
        f"data.seq_len={seq_len}",
        "data.global_batch_size=8",
        "data.micro_batch_size=8",
        f"train.max_steps={steps}",
        f"train.eval_every={steps}",
        f"train.save_every={steps}",
    ]
    result = train(load_config("tiny-moe-cpt", overrides), progress=False)
    loss = result.final_val_loss
    assert loss is not None, "the run evaluated nothing"
    return loss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assert cli(["demo", "--data-only", "--quick", "--out", str(root / "runs/tiny")]) == 0
        losses = {r: {s: run_one(root, r, s, args.steps, args.seq_len) for s in seeds} for r in RECIPES}
    print(
        f"moe_cpt  tiny-moe-cpt  {args.steps} steps x 8 x {args.seq_len} tokens  seeds {seeds.start}-{seeds.stop - 1}  "
        f"{time.perf_counter() - start:.0f} s  {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    )
    print(f"on {machine_description(threads_per_run=1)}")
    for recipe in RECIPES:
        row = "  ".join(f"{losses[recipe][s]:.4f}" for s in seeds)
        line = f"{recipe:<11} held-out loss {row}"
        if recipe != "bf16":
            gaps = list(paired_gaps(losses[recipe], losses["bf16"], relative=True).values())
            v = paired_verdict(gaps, MARGIN_PCT, higher_is_better=False)
            line += f"   gap {v.mean:+.2f}% [{v.low:+.2f}, {v.high:+.2f}]  {v.label}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
