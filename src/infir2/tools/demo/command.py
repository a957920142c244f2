"""The whole recipe on a laptop CPU: the baseline vs FP8 over seeds, on real text (the verdict) and
on a generated reasoning task (CPT then SFT then accuracy), every figure computed from the runs.

`infir2 demo` (no arguments, no network) does, on 2 CPU cores:

1. generates its data deterministically (``infir2.tools.demo.data``: an arithmetic corpus for CPT, and a
   multi-step arithmetic reasoning task with worked steps for SFT, plus held-out test problems);
2. trains a byte-level BPE tokenizer on it (digits split, ChatML specials) and packs the CPT corpus
   (a share held out: the CPT held-out loss);
3. for each recipe -- by default the high-precision baseline (``bf16``; computed in fp32 on a CPU,
   which has no fast bf16) and FP8 ``blockwise`` (the InfiR2 / DeepSeek-V3 recipe); add e.g. FP8
   ``tensorwise`` (the naive FP8) with ``--recipes`` -- and each seed (``--seeds``, default 0,1; a
   seed sets the initialization and the data order, the same for every recipe) builds a Qwen2-style model (~1M parameters), continually pre-trains it,
   then fine-tunes it on the reasoning task;
4. evaluates each fine-tuned model on the held-out problems with the evaluation protocol of the
   recipe (system prompt, ``<think>`` opened, answer in the last ``\\boxed{}``; greedy decoding);
5. **the verdict, on real text** (``demo/text.py``): the same recipes and seeds train a Qwen2-style
   model of width 256 (a 1x128 tile is half a row) for 100 steps on the King James Bible with a
   locally trained BPE, and the held-out losses are compared, paired by seed (``infir2 fidelity``'s
   runs). The arithmetic task above is a chaotic regime for such a comparison (runs differing only
   by fp32 rounding end several % apart), real text is quiet (seed spread ~1%, gaps ~0.2%);
6. saves every run's numbers to ``results.json`` and renders from it ``report.md``,
   ``readme_table.md`` and ``loss_curves.png``: per FP8 recipe the gap to the baseline at the same
   seed (CPT held-out loss, SFT val loss, accuracy) as mean +- sd over seeds, next to the baseline's
   own seed-to-seed spread, and a generated sentence saying whether FP8 is within that noise
   (``|mean gap| <= spread`` for every metric).

The time grows with recipes x seeds. On a CPU the FP8 GEMMs are emulated exactly (FP8 values, fp32
products), so FP8 runs are *slower* here; the demo shows the numerics, not the speed. Speed is
measured by `infir2 bench` on a GPU.

Examples:
  infir2 demo                         # the full demo into runs/demo
  infir2 demo --quick --out /tmp/d    # a reduced run (about a minute), as in CI
  infir2 demo --recipes bf16,blockwise,tensorwise         # + the naive FP8 (about 4 minutes more)
  infir2 demo --recipes bf16,blockwise,rowwise --seeds 0,1,2
  infir2 demo --report-only --out runs/demo              # report.md + plot again from results.json
  infir2 demo --update-readme README.md --out runs/demo  # README's demo table from results.json
  infir2 demo --data-only --out runs/tiny   # only tokenizer + CPT shards + SFT files: what the
                                            # tiny configs (src/infir2/configs/tiny-*.yaml) read
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from ...fp8 import RECIPES
from .pipeline import FULL, QUICK, data_only, run_demo
from .report import README_END, README_START, render, update_readme
from .results import DemoRecord

__all__ = ["add_arguments", "parse_seeds", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    parser.add_argument("--quick", action="store_true", help="a reduced run (about a minute), as in CI")
    parser.add_argument("--data-only", action="store_true",
                        help="only write the tokenizer (OUT/tokenizer), CPT shards (OUT/cpt_tokens) and SFT "
                             "files (OUT/data/sft_*.jsonl); with --out runs/tiny, what the tiny configs read")  # fmt: skip
    parser.add_argument("--recipes", default="bf16,blockwise",
                        help="comma-separated recipes; the first is the baseline of the gaps "
                             "(default: bf16,blockwise; each added recipe adds its runs to the time)")  # fmt: skip
    parser.add_argument("--seeds", default=None,
                        help="comma-separated seeds, each run by every recipe (initialization and data "
                             f"order; default: {','.join(map(str, FULL.seeds))}). The verdict needs two or "
                             "more: it compares each gap with the baseline's spread over seeds")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=None,
                        help="(recipe, seed) runs trained side by side in worker processes (default: one per "
                             "CPU core, at most one per run; 1 = one after the other, with progress bars)")  # fmt: skip
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: render OUT/report.md, OUT/readme_table.md and OUT/loss_curves.png "
                             "again from OUT/results.json")  # fmt: skip
    parser.add_argument("--update-readme", metavar="README", default=None,
                        help=f"train nothing: replace the block between {README_START} and {README_END} in "
                             "README with the table rendered from OUT/results.json")  # fmt: skip


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"0,1"`` -> ``(0, 1)``; an empty list, a non-integer, a negative or a repeated seed is an error."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    if not words:
        raise ValueError(f"--seeds: expected comma-separated integers such as 0,1; got {text!r}")
    bad = [w for w in words if not w.isdigit()]
    if bad:
        raise ValueError(f"--seeds: {', '.join(map(repr, bad))} is not a non-negative integer (in {text!r})")
    seeds = tuple(int(w) for w in words)
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise ValueError(f"--seeds: seed(s) {repeated} given twice (in {text!r})")
    return seeds


def run(args: argparse.Namespace) -> int:
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        raise ValueError(f"--recipes: unknown {unknown or 'empty list'}; known recipes: {', '.join(RECIPES)}")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    settings = QUICK if args.quick else FULL
    if args.seeds is not None:
        settings = dataclasses.replace(settings, seeds=parse_seeds(args.seeds))
    out = Path(args.out)
    if args.data_only and (args.report_only or args.update_readme):
        raise ValueError("--data-only trains nothing and writes no results; it does not go with --report-only "
                         "or --update-readme")  # fmt: skip
    if args.report_only or args.update_readme:
        record = DemoRecord.load(out / "results.json")
        if args.report_only:
            print(render(out, record))
        if args.update_readme:
            update_readme(Path(args.update_readme), record)
            print(f"updated the demo table in {args.update_readme} from {out / 'results.json'}")
        return 0
    if args.data_only:
        paths = data_only(out, settings)
        for name in ("tokenizer", "cpt", "sft_train", "sft_val"):
            print(f"{name}: {paths[name]}")
        return 0
    jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
    run_demo(out, settings, recipes, jobs)
    return 0
