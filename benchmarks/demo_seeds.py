"""Seed study of the demo's reasoning part: accuracy per seed per recipe, for settings you choose.

Runs the demo's own pipeline (``infir2.tools.demo.pipeline``: ``prepare_data`` then ``run_recipe``: CPT ->
SFT -> greedy evaluation) for each recipe at each seed, with ``DemoSettings`` overridden by ``--set
key=value`` (e.g. ``--set cpt_steps=400 --set sft_lr=2e-3``), and prints the accuracy of every run,
per recipe the min / mean over seeds, the paired gap to the baseline with the verdict rule of
``infir2.tools.paired``, and per seed the SFT step at which the run left the loss plateau of a model
that does not yet copy the third operand (``plateau_left_at``; a late one leaves too few steps). ``fp8_exact`` is the null control: the FP8 code path with exact casts (1x1 blocks,
fp32 scales), a ~1e-7 perturbation per GEMM; a setting is reliable when it sits within a few points
of the baseline at every seed.

Runs go ``--jobs`` at a time in worker processes of one thread each; a finished run's result is
kept in ``OUT/<tag>/results/`` and reused, so a sweep can be extended seed by seed.

Run: ``nice python benchmarks/demo_seeds.py --out /tmp/demo_seeds --seeds 0,1,2,3`` (the default
demo's settings); BENCHMARKS.md ("The reasoning task, seed by seed") has the study.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from infir2.tools.demo import FULL, QUICK, DemoSettings
from infir2.tools.demo.pipeline import prepare_data, run_recipe
from infir2.tools.demo.summary import METRICS
from infir2.tools.demo.workers import die_with_parent
from infir2.tools.paired import paired_gaps, paired_verdict

Settings = TypeVar("Settings")

ACCURACY = next(m for m in METRICS if m.key == "accuracy")


def parse_sets(items: list[str], base: Settings) -> Settings:
    """``["cpt_steps=400", "num_ops=2,3"]`` -> ``base`` (a dataclass: ``DemoSettings``, the RL study's
    ``RLStudy``) with those fields replaced, each value read as the field's current type (a tuple's
    items as its first item's; ``none``: None, for an optional field)."""
    values: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(base)}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(fields)}")
        current = getattr(base, key)
        if isinstance(current, tuple):
            kind = type(current[0]) if current else int
            values[key] = tuple(kind(v) for v in text.split(","))
        elif text == "none":  # an optional field unset
            values[key] = None
        elif isinstance(current, bool):
            values[key] = text.lower() in ("1", "true", "yes")
        elif isinstance(current, int) or current is None:
            values[key] = int(text) if text.lstrip("-").isdigit() else float(text)
        else:
            values[key] = type(current)(text)
    return dataclasses.replace(base, **values)


# The SFT loss of a run that copies the first two operands but not the third sits at ~0.07 (the
# entropy of guessing it, spread over the answer's tokens); a run leaves that plateau in one drop whose
# step varies by seed, and a late drop leaves too few steps to learn the rest.
_PLATEAU_WINDOW, _PLATEAU_LOSS = 20, 0.04


def plateau_left_at(losses: list[float]) -> int | None:
    """The first SFT step whose mean training loss over the last 20 steps is below 0.04; None: never."""
    for end in range(_PLATEAU_WINDOW, len(losses) + 1):
        if statistics.fmean(losses[end - _PLATEAU_WINDOW : end]) < _PLATEAU_LOSS:
            return end
    return None


def _worker(recipe: str, seed: int, out: Path, s: DemoSettings, data: dict[str, Path]) -> dict[str, Any]:
    import logging

    import torch

    from infir2.data.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, force=True)
    r = run_recipe(recipe, seed, out, s, data, load_tokenizer(out / "tokenizer"), progress=False)
    result = {
        "recipe": recipe,
        "seed": seed,
        "accuracy": r.accuracy,
        "cpt_val_loss": r.cpt_val_loss,
        "sft_val_loss": r.sft_val_loss,
        "seconds": r.seconds,
        "unparseable": r.unparseable,
        "hard_accuracy": r.hard_accuracy,
        "plateau_left_at": plateau_left_at([loss for _, loss in r.sft_curve]),
        "sft_steps": len(r.sft_curve),
    }
    path = out / "results" / f"{recipe}_s{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def _plateau_cell(res: dict[tuple[str, int], dict[str, Any]], recipe: str, seeds: list[int]) -> str:
    """``"130 / 168 / never (of 568)"``: per seed, where SFT left its plateau (older results: —)."""
    runs = [res[(recipe, k)] for k in seeds]
    if any("plateau_left_at" not in r for r in runs):
        return "—"
    steps = " / ".join(str(r["plateau_left_at"] or "never") for r in runs)
    return f"{steps} (of {max(r['sft_steps'] for r in runs)})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/tmp/demo_seeds"), help="work folder (runs are reused)")
    p.add_argument("--tag", default="default", help="name of this setting (a subfolder of --out)")
    p.add_argument(
        "--recipes", default="bf16,blockwise,fp8_exact", help="comma list; the first is the baseline"
    )
    p.add_argument("--seeds", default="0,1,2,3", help="comma list of seeds")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a DemoSettings field"
    )
    p.add_argument("--quick", action="store_true", help="start from the QUICK settings instead of FULL")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (one thread each)")
    args = p.parse_args()
    s = parse_sets(args.set, QUICK if args.quick else FULL)
    recipes = args.recipes.split(",")
    seeds = [int(x) for x in args.seeds.split(",")]
    out = args.out / args.tag
    t0 = time.perf_counter()
    if not (out / "tokenizer").is_dir():
        out.mkdir(parents=True, exist_ok=True)
        data, _ = prepare_data(out, s)
        (out / "data_paths.json").write_text(json.dumps({k: str(v) for k, v in data.items()}))
    data = {k: Path(v) for k, v in json.loads((out / "data_paths.json").read_text()).items()}
    done = {(r, k): out / "results" / f"{r}_s{k}.json" for r in recipes for k in seeds}
    todo = [(r, k) for (r, k), path in done.items() if not path.is_file()]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        args.jobs, mp_context=context, initializer=die_with_parent, initargs=(os.getpid(),)
    ) as pool:
        for f in [pool.submit(_worker, r, k, out, s, data) for r, k in todo]:
            res = f.result()
            print(
                f"  {res['recipe']} s{res['seed']}: {100 * res['accuracy']:.0f}% in {res['seconds']:.0f} s",
                flush=True,
            )
    res = {key: json.loads(path.read_text()) for key, path in done.items()}
    print(
        f"\n# demo_seeds {args.tag}: {' '.join(args.set) or '(defaults)'}  [{platform.machine()}, "
        f"1 thread per run, {args.jobs} side by side, {time.perf_counter() - t0:.0f} s]\n"
    )
    print(
        "| recipe | " + " | ".join(f"s{k}" for k in seeds) + " | min | mean | paired gap, 95% t-interval "
        f"(margin +-{ACCURACY.margin:g} points) | SFT plateau left at step (of N) | harder split | s per run |"
    )
    print("|---|" + "---|" * (len(seeds) + 6))
    base = {k: res[(recipes[0], k)]["accuracy"] for k in seeds}
    for r in recipes:
        acc = {k: res[(r, k)]["accuracy"] for k in seeds}
        secs = statistics.fmean(res[(r, k)]["seconds"] for k in seeds)
        gap = "—"
        if r != recipes[0]:
            gaps = paired_gaps(
                {k: 100 * a for k, a in acc.items()}, {k: 100 * b for k, b in base.items()}, False
            )
            v = paired_verdict(list(gaps.values()), ACCURACY.margin, higher_is_better=True)
            gap = f"{v.mean:+.1f} [{v.low:+.1f}, {v.high:+.1f}]: {v.label}"
        hard = [h for k in seeds if (h := res[(r, k)].get("hard_accuracy")) is not None]
        cells = [f"{100 * acc[k]:.1f}%" for k in seeds]
        print(
            f"| {r} | " + " | ".join(cells) + f" | {100 * min(acc.values()):.1f}% | "
            f"{100 * statistics.fmean(acc.values()):.1f}% | {gap} | {_plateau_cell(res, r, seeds)} | "
            f"{f'{100 * statistics.fmean(hard):.1f}%' if hard else '—'} | {secs:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
