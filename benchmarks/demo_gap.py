"""Why did the demo's FP8 runs lose CPT loss? Held-out loss, paired seeds, telemetry and ablations.

The README's demo table (one seed) showed FP8 blockwise +4.3% and tensorwise +5.9% CPT loss over the
baseline, where "CPT loss" is the *last training batch's* loss after the demo's CPT stage. This
script reruns exactly that stage (the demo's own ``_cpt_config`` and ``prepare_data``: hidden 128,
4 layers, vocab 400, seq 64, batch 8, lr 3e-3 WSD, 900 steps) and measures instead:

* **held-out loss** (the whole CPT validation split, high-precision eval) every ``--eval-every``
  steps, for each recipe at each seed (``run.seed`` = init and data order); the *paired* gap
  (FP8 minus baseline at the same seed) next to the baseline's own seed spread;
* how noisy the last-batch training loss is (its spread over the last 100 steps);
* the FP8 telemetry (``fp8.stats_every``): per GEMM result (fprop Y, dgrad dX, wgrad dW) the SQNR
  over layers, per operand the underflow, and the activation / gradient amax over steps;
* **ablations** (``--ablations`` groups, at ``--ablation-seeds``): ``exact``, the null control
  ``fp8_exact`` (every operand cast with 1x1 blocks and fp32 scales: each element is its own block,
  its FP8 code is +-448 and its value survives to fp32 rounding, ~140 dB, so the run differs from
  the baseline by ~1e-7 per GEMM and nothing else); ``gemm``, blockwise with one GEMM's two operands
  cast that way (wgrad, dgrad, fprop); ``e5m2`` gradients; ``scale``, fp32 instead of pow2 scales;
  ``lr``, the learning rate / 3; ``wide``, hidden 256 (the recipes of ``--recipes``).

Each run writes ``OUT/runs/<tag>/seed<k>/metrics.jsonl``; a finished run is reused on the next
call, so the tables can be reprinted (``--tables-only``) or extended. Runs go ``--jobs`` at a time in
worker processes of one thread each.

Run: ``OMP_NUM_THREADS=1 nice python benchmarks/demo_gap.py --out /tmp/demo_gap`` (main grid),
then e.g. ``--ablations exact,gemm --ablation-seeds 2``; ``--quick`` is a smoke run (2 layers, 30
steps, ~1 minute). BENCHMARKS.md ("Why the demo's FP8 runs lost 4.3% CPT loss") has the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import platform
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from infir2.fp8 import RECIPES
from infir2.fp8.recipe import Cast, Fp8Recipe, get_recipe
from infir2.tools.demo import FULL, QUICK, DemoSettings
from infir2.tools.demo.pipeline import _cpt_config, prepare_data

# one element per block, fp32 scale: the value survives to fp32 rounding
EXACT = Cast((1, 1), scale_encoding="fp32")
GEMMS = ("fprop.y", "dgrad.dx", "wgrad.dw")
OPERANDS = ("fprop.x", "fprop.w", "dgrad.dy", "dgrad.w", "wgrad.dy", "wgrad.x")
TRAIN_NOISE_WINDOW = 100  # last steps over which the training loss's spread is measured
BASELINE = "bf16"


def _ablation_recipes() -> dict[str, Fp8Recipe]:
    bw = RECIPES["blockwise"]
    return {
        "bw_fp32_fprop": replace(bw, name="bw_fp32_fprop", x=EXACT, w=EXACT),
        "bw_fp32_dgrad": replace(bw, name="bw_fp32_dgrad", dy=EXACT, w_dgrad=EXACT),
        "bw_fp32_wgrad": replace(bw, name="bw_fp32_wgrad", dy_wgrad=EXACT, x_wgrad=EXACT),
        "bw_e5m2_grads": replace(
            bw, name="bw_e5m2_grads", dy=replace(bw.dy, fmt="e5m2"), dy_wgrad=replace(bw.dy_wgrad, fmt="e5m2")
        ),
        "bw_e4m3_fp32scale": get_recipe("blockwise", scale_encoding="fp32"),
        # every operand exact: the FP8 path's arithmetic with ~fp32 values, a ~1e-7 perturbation
        "fp8_exact": Fp8Recipe("fp8_exact", EXACT, EXACT, EXACT, EXACT, EXACT, EXACT),
    }


#: ``--ablations`` groups -> the recipes they add (``lr`` and ``wide`` change the setting instead)
ABLATION_GROUPS: dict[str, tuple[str, ...]] = {
    "gemm": ("bw_fp32_wgrad", "bw_fp32_dgrad", "bw_fp32_fprop"),
    "e5m2": ("bw_e5m2_grads",),
    "scale": ("bw_e4m3_fp32scale",),
    "exact": ("fp8_exact",),
    "lr": (),
    "wide": (),
}


def register_ablations() -> None:
    """Make the ablation recipes known to the config validation (this process only)."""
    for name, recipe in _ablation_recipes().items():
        RECIPES.setdefault(name, replace(recipe, name=name))


@dataclass(frozen=True)
class Run:
    """One CPT run: ``tag`` names the variant (recipe + setting changes), ``seed`` is run.seed."""

    tag: str
    recipe: str
    seed: int
    settings: DemoSettings

    def dir(self, out: Path) -> Path:
        return out / "runs" / self.tag / f"seed{self.seed}"


def _config(run: Run, out: Path, vocab: int, eval_every: int, stats_every: int) -> dict[str, Any]:
    cfg = _cpt_config(run.settings, out / "data", run.recipe, run.seed, vocab)
    cfg["run"].update(name=f"{run.tag}/seed{run.seed}", out_dir=str(out / "runs"))
    stats = stats_every if RECIPES[run.recipe].enabled else 0
    cfg["fp8"].update(stats_every=stats)
    cfg["train"].update(eval_every=eval_every, eval_batches=20, log_every=10**9, save_every=0)
    return cfg


def _worker(run: Run, out: Path, eval_every: int, stats_every: int) -> tuple[str, float]:
    import logging

    from infir2.data.tokenizer import load_tokenizer
    from infir2.train import parse_config, train

    torch.set_num_threads(1)
    register_ablations()
    logging.basicConfig(level=logging.WARNING, force=True)
    tokenizer = load_tokenizer(out / "data" / "tokenizer")
    t0 = time.perf_counter()
    cfg = _config(run, out, len(tokenizer), eval_every, stats_every)
    train(parse_config(cfg, f"demo_gap:{run.tag}/seed{run.seed}"), tokenizer=tokenizer, progress=False)
    seconds = time.perf_counter() - t0
    (run.dir(out) / "done.json").write_text(json.dumps({"seconds": seconds}))
    return f"{run.tag}/seed{run.seed}", seconds


def execute(runs: list[Run], out: Path, jobs: int, eval_every: int, stats_every: int) -> None:
    todo = [r for r in runs if not (r.dir(out) / "done.json").is_file()]
    if not todo:
        return
    if not (out / "data" / "cpt_tokens" / "meta.json").is_file():
        prepare_data(out / "data", FULL)
    print(f"running {len(todo)} run(s), {jobs} at a time", flush=True)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_worker, r, out, eval_every, stats_every) for r in todo]
        for f in futures:
            name, seconds = f.result()
            print(f"  done {name} in {seconds:.0f} s", flush=True)


# ---- reading the runs --------------------------------------------------------------------------


def _metrics(run: Run, out: Path) -> list[dict[str, Any]]:
    path = run.dir(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _val_curve(m: list[dict[str, Any]]) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in m if "val_loss" in r}


def _pct(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+6.2f}%"


def table_val(runs: list[Run], out: Path, tags: list[str], seeds: list[int]) -> str:
    """Held-out loss vs step: baseline per seed with its spread, each variant's paired gap per seed."""
    curves = {(r.tag, r.seed): _val_curve(_metrics(r, out)) for r in runs}
    base_tag = tags[0]
    steps = sorted(curves[(base_tag, seeds[0])])
    head = ["step"] + [f"{base_tag} s{s}" for s in seeds]
    if len(seeds) > 1:
        head.append("seed spread")
    for tag in tags[1:]:
        head += [f"{tag} s{s}" for s in seeds]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for step in steps:
        base = [curves[(base_tag, s)].get(step, math.nan) for s in seeds]
        row = [str(step)] + [f"{b:.4f}" for b in base]
        if len(seeds) > 1:
            row.append(f"{100 * (max(base) - min(base)) / statistics.mean(base):.2f}%")
        for tag in tags[1:]:
            row += [_pct(curves[(tag, s)].get(step, math.nan), b) for s, b in zip(seeds, base, strict=True)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def table_final(runs: list[Run], out: Path) -> str:
    """Last-batch training loss (the README's "CPT loss") vs its noise and vs the held-out loss."""
    lines = [
        "| run | last-batch loss | mean / std of last 100 train losses | held-out loss | seconds |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        m = _metrics(r, out)
        losses = [x["loss"] for x in m if "loss" in x and not x.get("skipped")]
        tail = losses[-TRAIN_NOISE_WINDOW:]
        val = _val_curve(m)
        done = json.loads((r.dir(out) / "done.json").read_text())
        lines.append(
            f"| {r.tag} s{r.seed} | {losses[-1]:.4f} | {statistics.mean(tail):.4f} / "
            f"{statistics.stdev(tail):.4f} | {val[max(val)]:.4f} | {done['seconds']:.0f} |"
        )
    return "\n".join(lines)


def _telemetry(m: list[dict[str, Any]]) -> dict[int, dict[tuple[str, str, str], float]]:
    from infir2.nn.telemetry import parse_key

    out: dict[int, dict[tuple[str, str, str], float]] = {}
    for rec in m:
        keys = {p: v for k, v in rec.items() if (p := parse_key(k)) is not None}
        if keys:
            out[rec["step"]] = keys
    return out


def _short(layer: str) -> str:
    return layer.replace("model.layers.", "L").replace(".self_attn.", ".").replace(".mlp.", ".")


def table_telemetry(run: Run, out: Path) -> str:
    """Per stats step: SQNR (dB) of each GEMM result, median / worst layer; underflow and amax."""
    tel = _telemetry(_metrics(run, out))
    if not tel:
        return f"({run.tag}: no telemetry)"
    head = ["step"] + [f"{g} med / min (layer)" for g in GEMMS]
    head += ["max underflow (operand, layer)", "fprop.x amax max", "dgrad.dy amax max"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for step, keys in sorted(tel.items()):
        row = [str(step)]
        for g in GEMMS:
            vals = {layer: v for (layer, what, s), v in keys.items() if what == g and s == "sqnr_db"}
            worst = min(vals, key=lambda k: vals[k])
            row.append(f"{statistics.median(vals.values()):.1f} / {vals[worst]:.1f} ({_short(worst)})")
        under = {(what, layer): v for (layer, what, s), v in keys.items() if s == "underflow"}
        w = max(under, key=lambda k: under[k])
        row.append(f"{under[w]:.1e} ({w[0]}, {_short(w[1])})")
        for op in ("fprop.x", "dgrad.dy"):
            row.append(f"{max(v for (_, what, s), v in keys.items() if what == op and s == 'amax'):.3g}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def table_operands(run: Run, out: Path) -> str:
    """Per operand at the first and last stats step: mean underflow over layers and the worst layer."""
    tel = _telemetry(_metrics(run, out))
    if not tel:
        return ""
    steps = sorted(tel)
    picks = [steps[0], steps[-1]] if len(steps) > 1 else steps
    head = ["operand"] + [f"underflow mean / max @ {s}" for s in picks]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op in OPERANDS:
        row = [op]
        for s in picks:
            vals = [v for (_, what, st), v in tel[s].items() if what == op and st == "underflow"]
            row.append(f"{statistics.mean(vals):.2e} / {max(vals):.2e}" if vals else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# ---- the plan ----------------------------------------------------------------------------------


def plan(args: argparse.Namespace) -> tuple[list[Run], list[tuple[str, list[str], list[int]]]]:
    """The runs and the val-loss tables (title, tags with the baseline first, seeds) to print."""
    base = QUICK if args.quick else FULL
    base = replace(base, cpt_steps=args.steps or base.cpt_steps)
    seeds = list(range(args.seeds))
    runs: list[Run] = []
    tables: list[tuple[str, list[str], list[int]]] = []

    def add(tag: str, recipe: str, s: DemoSettings, run_seeds: list[int]) -> None:
        runs.extend(Run(tag, recipe, k, s) for k in run_seeds)

    main = [BASELINE, *args.recipes]
    for recipe in main:
        add(recipe, recipe, base, seeds)
    tables.append(
        (f"demo setting (hidden {base.hidden_size}, lr {base.cpt_lr:g}, {base.cpt_steps} steps)", main, seeds)
    )
    groups = [g for g in args.ablations.split(",") if g]
    unknown = set(groups) - set(ABLATION_GROUPS)
    if unknown:
        raise SystemExit(
            f"--ablations: unknown group(s) {sorted(unknown)}; known: {', '.join(ABLATION_GROUPS)}"
        )
    a_steps = args.ablation_steps or base.cpt_steps
    a_base = replace(base, cpt_steps=a_steps)
    a_seeds = list(range(args.ablation_seeds))
    sfx = "" if a_steps == base.cpt_steps else f"@{a_steps}"
    recipes = [r for g in groups for r in ABLATION_GROUPS[g]]
    if recipes:
        refs = [BASELINE, "blockwise"]
        for recipe in refs + recipes:
            add(recipe + sfx, recipe, a_base, a_seeds)
        tables.append(
            (f"ablations of blockwise ({a_steps} steps)", [r + sfx for r in refs + recipes], a_seeds)
        )
    variants = {
        "lr": ("lr1e-3", replace(a_base, cpt_lr=a_base.cpt_lr / 3)),
        "wide": (
            "h256",
            replace(
                a_base, hidden_size=2 * a_base.hidden_size, intermediate_size=2 * a_base.intermediate_size
            ),
        ),
    }
    for g in ("lr", "wide"):
        if g in groups:
            name, s = variants[g]
            tags = [f"{r}_{name}{sfx}" for r in main]
            for tag, recipe in zip(tags, main, strict=True):
                add(tag, recipe, s, a_seeds)
            tables.append((f"{name} ({a_steps} steps)", tags, a_seeds))
    return runs, tables


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/tmp/demo_gap"), help="work folder (runs are reused)")
    p.add_argument("--recipes", nargs="+", default=["blockwise", "tensorwise"], help="FP8 recipes vs bf16")
    p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 (run.seed: init and data order)")
    p.add_argument("--steps", type=int, default=0, help="CPT steps (default: the demo's, 900)")
    p.add_argument("--eval-every", type=int, default=100, help="held-out loss every N steps")
    p.add_argument("--stats-every", type=int, default=100, help="FP8 telemetry every N steps")
    p.add_argument(
        "--ablations", default="", help=f"comma list of ablation groups: {', '.join(ABLATION_GROUPS)}"
    )
    p.add_argument(
        "--ablation-seeds", type=int, default=1, help="seeds of the ablation runs (default 1: seed 0)"
    )
    p.add_argument(
        "--ablation-steps", type=int, default=0, help="CPT steps of the ablations (default: --steps)"
    )
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (one thread each)")
    p.add_argument(
        "--tables-only", action="store_true", help="print the tables of finished runs, run nothing"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: the demo's QUICK sizes, 30 steps, 1 seed")
    args = p.parse_args()
    if args.quick:
        args.steps, args.seeds, args.eval_every, args.stats_every = args.steps or 30, 1, 10, 10
    register_ablations()
    runs, tables = plan(args)
    runs = list({(r.tag, r.seed): r for r in runs}.values())  # once each (ablations repeat the references)
    if not args.tables_only:
        execute(runs, args.out, args.jobs, args.eval_every, args.stats_every)
    runs = [r for r in runs if (r.dir(args.out) / "done.json").is_file()]
    done = {(r.tag, r.seed) for r in runs}
    print(
        f"# demo_gap  {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  {platform.processor() or platform.machine()}"
        f"  torch {torch.__version__}\n"
    )
    for title, tags, seeds in tables:
        if all((t, s) in done for t in tags for s in seeds):
            print(f"## held-out loss, {title}: baseline per seed, others as paired gap vs same seed\n")
            print(table_val(runs, args.out, tags, seeds) + "\n")
    print("## last-batch training loss vs held-out loss\n")
    print(table_final(runs, args.out) + "\n")
    for r in runs:
        if r.seed == 0 and RECIPES[r.recipe].enabled and r.tag in ("blockwise", "tensorwise"):
            print(f"## telemetry {r.tag} seed 0: SQNR (dB) per GEMM over layers, underflow, amax\n")
            print(table_telemetry(r, args.out) + "\n")
            print(table_operands(r, args.out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
