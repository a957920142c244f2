"""The whole recipe on embedded data, on a laptop CPU: CPT then SFT, the baseline vs FP8, side by side.

`infir2 demo` (no arguments, no network) does, in a few minutes on 2 CPU cores:

1. generates its data deterministically (``infir2.data.demo``: an arithmetic corpus for CPT, and a
   multi-step arithmetic reasoning task with worked steps for SFT, plus held-out test problems);
2. trains a byte-level BPE tokenizer on it (digits split, ChatML specials) and packs the CPT corpus;
3. for each recipe -- the high-precision baseline (``bf16``; computed in fp32 on a CPU, which has no
   fast bf16), FP8 ``blockwise`` (the InfiR2 / DeepSeek-V3 recipe) and FP8 ``tensorwise`` (the naive
   FP8) -- builds the same seeded Qwen2-style model (~1M parameters), continually pre-trains it, then
   fine-tunes it on the reasoning task;
4. evaluates each fine-tuned model on the held-out problems with the evaluation protocol of the
   recipe (system prompt, ``<think>`` opened, answer in the last ``\\boxed{}``; greedy decoding);
5. writes ``report.md`` and ``loss_curves.png`` in the output folder: final losses, the gap to the
   baseline in %, task accuracy, tokens/s.

On a CPU the FP8 GEMMs are emulated exactly (FP8 values, fp32 products), so FP8 runs are *slower*
here; the demo shows the numerics (FP8 tracks the baseline), not the speed. Speed is measured by
`infir2 bench` on a GPU.

Examples:
  infir2 demo                         # the full demo into runs/demo (about 10 minutes on 2 cores)
  infir2 demo --quick --out /tmp/d    # a reduced run (about a minute), as in CI
  infir2 demo --recipes bf16,blockwise,rowwise
  infir2 demo --data-only --out runs/tiny   # only tokenizer + CPT shards + SFT files: what the
                                            # tiny configs (src/infir2/configs/tiny-*.yaml) read
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..fp8 import RECIPES
from .pipeline import FULL, QUICK, data_only, run_demo

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    parser.add_argument("--quick", action="store_true", help="a reduced run (about a minute), as in CI")
    parser.add_argument("--data-only", action="store_true",
                        help="only write the tokenizer (OUT/tokenizer), CPT shards (OUT/cpt_tokens) and SFT "
                             "files (OUT/data/sft_*.jsonl); with --out runs/tiny, what the tiny configs read")  # fmt: skip
    parser.add_argument("--recipes", default="bf16,blockwise,tensorwise",
                        help="comma-separated recipes; the first is the baseline of the gaps "
                             "(default: bf16,blockwise,tensorwise)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=None,
                        help="recipes trained side by side in worker processes (default: one per CPU "
                             "core, at most one per recipe; 1 = one after the other, with progress bars)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        raise ValueError(f"--recipes: unknown {unknown or 'empty list'}; known recipes: {', '.join(RECIPES)}")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    if args.data_only:
        paths = data_only(Path(args.out), QUICK if args.quick else FULL)
        for name in ("tokenizer", "cpt", "sft_train", "sft_val"):
            print(f"{name}: {paths[name]}")
        return 0
    jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
    run_demo(Path(args.out), QUICK if args.quick else FULL, recipes, jobs)
    return 0
