"""The whole recipe on a laptop CPU: the baseline vs FP8 over seeds, on a generated reasoning task
(CPT then SFT then accuracy) and on real text, every figure and verdict computed from the runs.

`infir2 demo` (no arguments, no network) does, on 2 CPU cores:

1. generates its data deterministically (``infir2.tools.demo.data``: an arithmetic corpus for CPT, and a
   multi-step arithmetic reasoning task with worked steps for SFT, plus held-out test problems);
2. trains a byte-level BPE tokenizer on it (digits split, every number below 100 one token, ChatML
   specials) and packs the CPT corpus (a share held out: the CPT held-out loss);
3. for each recipe -- by default the high-precision baseline (``bf16``; computed in fp32 on a CPU),
   FP8 ``blockwise`` (the InfiR2 / DeepSeek-V3 recipe) and the null control ``fp8_exact`` (the FP8
   code path with exact casts: the baseline perturbed by fp32 rounding alone); add e.g. FP8
   ``tensorwise`` (the naive FP8) with ``--recipes`` -- and each seed (``--seeds``, default 0,1,2; a
   seed sets the initialization and the data order, the same for every recipe) builds a Qwen2-style
   model (~0.35M parameters), continually pre-trains it, then fine-tunes it on the reasoning task;
4. evaluates each fine-tuned model on the held-out problems with the evaluation protocol of the
   recipe (system prompt, ``<think>`` opened, answer in the last ``\\boxed{}``; greedy decoding);
5. trains the same recipes and seeds on real text (``demo/text.py``): a Qwen2-style model of width
   256 (a 1x128 tile is half a row), 64 steps at lr 1e-3 on the King James Bible with a locally
   trained BPE, the held-out loss (128 held-out windows) every 16 steps, a run's loss its last,
   paired by seed (``infir2 fidelity``'s runs);
6. saves every run's numbers to ``results.json`` and renders from it ``report.md``,
   ``readme_table.md``, ``verdict.png`` and ``loss_curves.png``: per FP8 recipe and metric the gap to
   the baseline at the same seed (held-out losses in %, accuracy in points) as its mean over seeds
   with a two-sided 95% Student t-interval, and a verdict against the metric's equivalence margin
   (+-1% real-text loss, +-2% CPT held-out loss, +-10% SFT val loss, +-3 accuracy points): equivalent
   (the interval inside the margin), worse / better (it excludes 0), else inconclusive: more seeds
   needed, with the seeds the measured gap would need. The headline reads the real-text loss and the
   accuracy; the reasoning task's two losses, whose seeds land tens of % apart, are reported beside
   it. The null control's gap is shown beside each FP8 gap, as the noise floor; ``verdict.png``
   draws each headline gap against its margin, and the real-text held-out loss over the steps.

The time grows with recipes x seeds. On a CPU the FP8 GEMMs are emulated exactly (FP8 values, fp32
products), so FP8 runs are *slower* here; the demo shows the numerics, not the speed. Speed is
measured by `infir2 bench` on a GPU.

Examples:
  infir2 demo                         # the full demo into runs/demo
  infir2 demo --quick --out /tmp/d    # a reduced run (about a minute), as in CI
  infir2 demo --recipes bf16,blockwise,fp8_exact,tensorwise   # + the naive FP8
  infir2 demo --seeds 0,1,2,3,4       # more seeds: narrower intervals
  infir2 demo --report-only --out runs/demo              # report.md + figures again from results.json
  infir2 demo --update-readme README.md --out runs/demo  # README's demo table from results.json
  infir2 demo --data-only --out runs/tiny   # only tokenizer + CPT shards + SFT files: what the
                                            # tiny configs (src/infir2/configs/tiny-*.yaml) read
  infir2 demo --rl --out runs/demo  # RL on the harder split: FP8 pair vs BF16 pair over 16 RL seeds
                                    # (demo/rl.py; --seeds are then the RL seeds)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from ..._paths import check_out_folder
from ..recipe_spec import check_tail, recipe_specs
from .pipeline import FULL, QUICK, data_only, run_demo
from .report import README_END, README_START, render, update_readme
from .results import DemoRecord

__all__ = ["DEFAULT_RECIPES", "QUICK_RECIPES", "add_arguments", "parse_seeds", "run"]

DEFAULT_RECIPES = ("bf16", "blockwise", "fp8_exact")
QUICK_RECIPES = ("bf16", "blockwise")  # CI: the pipeline end to end, kept short


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    parser.add_argument("--quick", action="store_true", help="a reduced run (about a minute), as in CI")
    parser.add_argument(
        "--data-only",
        action="store_true",
        help="only write the tokenizer (OUT/tokenizer), CPT shards (OUT/cpt_tokens) and SFT "
        "files (OUT/data/sft_*.jsonl); with --out runs/tiny, what the tiny configs read",
    )
    parser.add_argument(
        "--recipes",
        default=None,
        help="comma-separated recipes; the first is the baseline of the gaps (default: "
        f"{','.join(DEFAULT_RECIPES)}, the last being the null control, the FP8 code path "
        f"with exact casts; with --quick: {','.join(QUICK_RECIPES)}; each added recipe adds "
        "its runs to the time). A recipe followed by +tail (e.g. nvfp4+tail) keeps the last 15%% of "
        "the decoder blocks in high precision, as 4-bit training does",
    )
    parser.add_argument(
        "--seeds",
        default=None,
        help="comma-separated seeds, each run by every recipe (initialization and data "
        f"order; default: {','.join(map(str, FULL.seeds))}). The verdict needs two or "
        "more, and resolves more with more: it is a t-interval over the paired gaps",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="(recipe, seed) runs trained side by side in worker processes (default: one per "
        "CPU core, at most one per run; 1 = one after the other, with progress bars)",
    )
    parser.add_argument(
        "--rl",
        action="store_true",
        help="RL on the harder split (three operations) from an SFT of the demo's CPT model (seed 0 "
        "in OUT, reused or trained) on its SFT conversations plus 120 of the harder split: "
        "fp8:blockwise beside high:bf16 over RL seeds (--seeds; default 0-15), OUT/rl/rl.png and the "
        "verdict (README: the time it takes)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: render OUT/report.md, OUT/readme_table.md, OUT/verdict.png and "
        "OUT/loss_curves.png again from OUT/results.json",
    )
    parser.add_argument(
        "--update-readme",
        metavar="README",
        default=None,
        help=f"train nothing: replace the block between {README_START} and {README_END} in "
        "README with the table rendered from OUT/results.json",
    )


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
    default = QUICK_RECIPES if args.quick else DEFAULT_RECIPES
    text = args.recipes if args.recipes is not None else ",".join(default)
    recipes = recipe_specs(text)
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    settings = QUICK if args.quick else FULL
    if args.seeds is not None:
        settings = dataclasses.replace(settings, seeds=parse_seeds(args.seeds))
    check_tail(recipes, settings.num_layers, "--recipes", "the demo's model")
    if settings.text_width:
        check_tail(recipes, settings.text_layers, "--recipes", "the demo's real-text model")
    out = Path(args.out)
    if args.data_only and (args.report_only or args.update_readme):
        raise ValueError(
            "--data-only trains nothing and writes no results; it does not go with --report-only "
            "or --update-readme"
        )
    _check_unused(args)
    if not (args.report_only or args.update_readme):  # a run: its folder checked before any work
        check_out_folder(out, "--out")
    if args.rl:
        return _run_rl(args, out)
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


def _check_unused(args: argparse.Namespace) -> None:
    """A flag that sets runs given where none is trained (--report-only / --update-readme render the
    saved results; --data-only writes data, of --quick's size or not) is refused, not ignored."""
    if args.rl:
        return  # _run_rl says which flags go with --rl
    mode = "--report-only" if args.report_only else "--update-readme" if args.update_readme else "--data-only"
    if not (args.report_only or args.update_readme or args.data_only):
        return
    unused = ["--recipes", "--seeds", "--jobs"] + ([] if args.data_only else ["--quick"])
    given = [f for f in unused if getattr(args, f[2:]) is not None and getattr(args, f[2:]) is not False]
    if given:
        raise ValueError(f"{given[0]} sets the runs a demo trains; {mode} trains none: drop {given[0]}")


def _run_rl(args: argparse.Namespace, out: Path) -> int:
    from .rl import QUICK_STUDY, STUDY, run_rl_study

    if args.data_only or args.report_only or args.update_readme or args.recipes is not None:
        raise ValueError(
            "--rl runs RL after the demo's SFT; it does not go with --data-only, --report-only, "
            "--update-readme or --recipes"
        )
    study = QUICK_STUDY if args.quick else STUDY
    if args.seeds is not None:
        study = dataclasses.replace(study, seeds=parse_seeds(args.seeds))
    jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
    run_rl_study(out, args.quick, study, jobs)
    return 0
