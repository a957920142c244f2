"""How quiet can the demo's real-text verdict be? The paired FP8 gap's sd over seeds, per candidate setting.

The demo's real-text leg (``infir2.tools.demo.text``: ``infir2 fidelity``'s width-256 runs on the King
James Bible) judges FP8 blockwise against the baseline by the paired held-out loss gap
``100 * (fp8 - base) / base`` over seeds with a 95% t-interval against +-1%. With the demo's three
seeds the interval's half-width is ``t(2) * sd / sqrt(3) = 2.48 sd``, so the gap's seed-to-seed sd
must be below ~0.4% for the verdict to resolve. This script trains, for each candidate setting of
``CANDIDATES``, the baseline and blockwise at every seed of ``--seeds`` through the real training
loop, and reports per *read-out* of the same runs:

* ``last16``: the last step's held-out loss on the first 16 held-out batches (what the demo read);
* ``last``: the last step's held-out loss on every held-out window (~51k tokens);
* ``avgK``: the mean of the last ``K`` of the run's 5 periodic held-out losses (``EVERY_WINDOW``: every
  window; the others: the demo's 16 batches);

the paired gap's mean and sd over seeds, the 3-seed t-interval half-width that sd implies, and the
cost of one run in CPU seconds (user + sys of the worker process, one thread: the cores are shared, so
wall clock would measure the neighbours), split into training and one evaluation of every window.

Every run is kept in ``OUT/<candidate>/<recipe>/s<seed>.json``; a finished run is reused, so the
table can be extended (``--candidates``) or reprinted (``--table-only``).

Run (BENCHMARKS.md, "The real-text leg's noise"):
  OMP_NUM_THREADS=1 nice -n 10 python benchmarks/real_text_noise.py --out /tmp/rtn --candidates current
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from infir2.tools.bench.fidelity import FidelitySettings, _run_config, prepare
from infir2.tools.demo.results import FULL
from infir2.tools.demo.text import text_settings
from infir2.tools.machine import cpu_description
from infir2.tools.paired import paired_verdict, t_quantile

RECIPES = ("bf16", "blockwise")
#: candidate -> (FidelitySettings overrides, overrides of the run config's schedule section)
CANDIDATES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "current": ({}, {}),  # the demo before issue 30: 80 steps x 8 x 128, lr 2e-3, 5% warm-up
    "lr1e-3": ({"lr": 1e-3}, {}),
    "lr1e-3_64steps": ({"lr": 1e-3, "steps": 64}, {}),  # a fifth fewer steps: the demo's time budget
    "decay50": ({}, {"decay_fraction": 0.5}),  # the WSD decay over the last half instead of the last fifth
    "decay50_min0": ({}, {"decay_fraction": 0.5, "min_lr_ratio": 0.0}),
    "lr1e-3_warm20": ({"lr": 1e-3}, {"warmup_fraction": 0.2}),
    "2layers_160steps": ({"layers": 2, "steps": 160}, {}),
    "batch16_40steps": ({"batch": 16, "steps": 40}, {}),
    "2layers_lr1e-3_160steps": ({"layers": 2, "steps": 160, "lr": 1e-3}, {}),
    "2layers_b16_80steps": ({"layers": 2, "batch": 16, "steps": 80}, {}),
    "2layers": ({"layers": 2}, {}),  # half the depth, the same steps: ~half the cost of ``current``
}
#: candidates whose periodic evaluations read every held-out window (the demo's read-out since issue 30)
EVERY_WINDOW = {"current", "2layers", "lr1e-3", "lr1e-3_64steps"}
EVALS = 5  # periodic held-out evaluations per run (every steps/EVALS steps), for the avgK read-outs
DEMO_BATCHES = 16  # the held-out batches the demo read before issue 30 ...
EVAL_BATCH = 8  # ... of this many windows each


def _settings(name: str) -> tuple[FidelitySettings, dict[str, Any]]:
    fs, extra = CANDIDATES[name]
    return replace(text_settings(FULL, list(RECIPES)), **fs), extra


def _config(name: str, out: Path, recipe: str, seed: int, vocab: int) -> dict[str, Any]:
    from infir2.data.tokens import heldout_windows, load_tokens

    s, extra = _settings(name)
    cfg = _run_config(s, out, s.widths[0], recipe, seed, vocab)
    cfg["run"]["out_dir"] = str(out / "runs" / name)
    windows = len(heldout_windows(len(load_tokens(out / "tokens", "val")), s.seq_len))
    # the periodic evaluations read the demo's 16 batches of 8 windows (EVERY_WINDOW: every window)
    every = name in EVERY_WINDOW
    batches = math.ceil(windows / s.batch) if every else DEMO_BATCHES * EVAL_BATCH // s.batch
    cfg["train"].update(eval_every=max(1, s.steps // EVALS), eval_from=0, eval_batches=batches)
    cfg["schedule"].update({k: v for k, v in extra.items() if k in cfg["schedule"]})
    return cfg


def _final_batches(model: Any, out: Path, s: FidelitySettings) -> list[tuple[float, int]]:
    """Per held-out batch of the trained model: (CE sum, loss tokens), fp32, every window in order."""
    from infir2.data.tokens import val_batches
    from infir2.loss import heldout_loss

    result = []
    for mb in val_batches(out / "tokens", s.seq_len, EVAL_BATCH):
        loss, n = heldout_loss(model, [[mb]], "fp32")
        result.append((loss * n, n))
    return result


def _worker(name: str, out: Path, recipe: str, seed: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from infir2.data.tokenizer import load_tokenizer
    from infir2.train import parse_config, train

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(out / "tokenizer")
    s, _ = _settings(name)
    cfg = _config(name, out, recipe, seed, len(tokenizer))
    t0 = time.process_time()
    res = train(parse_config(cfg, f"noise:{name}/{recipe}/s{seed}"), tokenizer=tokenizer, progress=False)
    train_cpu = time.process_time() - t0
    assert res.hf_dir is not None
    model = AutoModelForCausalLM.from_pretrained(res.hf_dir, local_files_only=True).float()
    t0 = time.process_time()
    final = _final_batches(model, out, s)
    eval_cpu = time.process_time() - t0
    record = {
        "config": cfg,
        "val_curve": [(m["step"], m["val_loss"]) for m in res.history if "val_loss" in m],
        "final_batches": final,
        "train_cpu_s": train_cpu,  # the periodic evaluations included
        "eval_cpu_s": eval_cpu,  # one evaluation of every held-out window
    }
    path = out / name / recipe / f"s{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    return f"{name} {recipe} s{seed}: {train_cpu:.0f} + {eval_cpu:.0f} CPU s"


def _load(out: Path, name: str, recipe: str, seed: int) -> dict[str, Any] | None:
    path = out / name / recipe / f"s{seed}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _readouts(run: dict[str, Any]) -> dict[str, float]:
    """The read-outs of one run: last16, last, avg2, avg3."""
    final = run["final_batches"]
    head = final[:DEMO_BATCHES]
    values = {
        "last16": sum(c for c, _ in head) / sum(n for _, n in head),
        "last": sum(c for c, _ in final) / sum(n for _, n in final),
    }
    curve = [v for _, v in run["val_curve"]]
    for k in (2, 3):
        values[f"avg{k}"] = statistics.fmean(curve[-k:])
    return values


def _periodic_windows(run: dict[str, Any]) -> int:
    """Held-out windows a periodic evaluation of ``run`` read (its config's eval batches x batch)."""
    return run["config"]["train"]["eval_batches"] * run["config"]["data"]["micro_batch_size"]


def _triples(gaps: list[float]) -> str:
    """The demo's verdict on each run of three consecutive seeds (0-2, 3-5, ...): eq / inc / worse / better."""
    short = {"equivalent": "eq", "worse": "worse", "better": "better"}
    labels = [
        short.get(paired_verdict(gaps[i : i + 3], 1.0, higher_is_better=False).label, "inc")
        for i in range(0, len(gaps) - 2, 3)
    ]
    return " / ".join(labels)


def table(out: Path, names: list[str], seeds: list[int]) -> str:
    t3 = t_quantile(2)
    lines = [
        "| candidate | read-out | seeds | paired gap % by seed | mean % | sd % | 3-seed half-width % "
        "| 3-seed verdicts (+-1%) | baseline loss | CPU s / run (train + eval) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        pairs = [(s, _load(out, name, "bf16", s), _load(out, name, "blockwise", s)) for s in seeds]
        done = [(s, b, f) for s, b, f in pairs if b is not None and f is not None]
        if len(done) < 2:
            continue
        runs = [r for _, b, f in done for r in (b, f)]
        eval_cpu = statistics.fmean(r["eval_cpu_s"] for r in runs)  # every window, EVAL_BATCH at a time
        windows = len(runs[0]["final_batches"]) * EVAL_BATCH
        periodic = _periodic_windows(runs[0]) / windows  # the share of the windows a periodic evaluation read
        train_cpu = statistics.fmean(
            r["train_cpu_s"] - len(r["val_curve"]) * periodic * r["eval_cpu_s"] for r in runs
        )
        costs = {"last16": eval_cpu * DEMO_BATCHES * EVAL_BATCH / windows, "last": eval_cpu}
        costs.update({f"avg{k}": k * periodic * eval_cpu for k in (2, 3)})
        for key, eval_cost in costs.items():
            gaps = [100 * (_readouts(f)[key] - _readouts(b)[key]) / _readouts(b)[key] for _, b, f in done]
            sd = statistics.stdev(gaps)
            base = statistics.fmean(_readouts(b)[key] for _, b, _ in done)
            lines.append(
                f"| {name} | {key} | {len(done)} | {' / '.join(f'{g:+.2f}' for g in gaps)} | "
                f"{statistics.fmean(gaps):+.2f} | {sd:.2f} | {t3 * sd / math.sqrt(3):.2f} | {_triples(gaps)} | {base:.4f} | "
                f"{train_cpu:.0f} + {eval_cost:.0f} |"
            )
    return "\n".join(lines)


def table_by_step(out: Path, names: list[str], seeds: list[int]) -> str:
    """The paired gap's sd (%) at each periodic evaluation (every held-out window): how the noise grows."""
    lines = []
    for name in names:
        pairs = [(_load(out, name, "bf16", s), _load(out, name, "blockwise", s)) for s in seeds]
        done = [(b, f) for b, f in pairs if b is not None and f is not None]
        if len(done) < 2:
            continue
        steps = [step for step, _ in done[0][0]["val_curve"]]
        cells = []
        for i, step in enumerate(steps):
            gaps = [
                100 * (f["val_curve"][i][1] - b["val_curve"][i][1]) / b["val_curve"][i][1] for b, f in done
            ]
            cells.append(f"step {step}: {statistics.stdev(gaps):.2f}")
        lines.append(f"- {name} ({len(done)} seeds), paired-gap sd % by step: " + ", ".join(cells))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--candidates", default="current", help=f"comma-separated, of {', '.join(CANDIDATES)}"
    )
    parser.add_argument("--seeds", default="0,1,2,3,4,5")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side (one thread each)")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    names = [n for n in args.candidates.split(",") if n]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise SystemExit(f"--candidates: unknown {unknown}; expected some of {', '.join(CANDIDATES)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    print(f"CPU: {cpu_description()}; {os.cpu_count()} CPUs")
    if not args.table_only:
        args.out.mkdir(parents=True, exist_ok=True)
        s, _ = _settings(names[0])
        if not (args.out / "tokenizer").is_dir():
            prepare(args.out, s)  # the corpus and tokenizer depend on vocab and max_chars only
        todo = [
            (n, r, seed)
            for n in names
            for seed in seeds
            for r in RECIPES
            if _load(args.out, n, r, seed) is None
        ]
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
            futures = [pool.submit(_worker, n, args.out, r, seed) for n, r, seed in todo]
            for f in futures:
                print(f.result(), flush=True)
    print(table(args.out, names, seeds))
    print(table_by_step(args.out, names, seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
