"""`infir2 demo --rl`: RL on the demo's harder split, FP8 rollouts + FP8 training beside the BF16 pair.

The question an RL stage must answer first: does it learn, and does FP8 learn as well as BF16? The start
(``start_model``) is an SFT of the demo's baseline CPT model at seed 0 on the demo's SFT conversations
plus ``start_hard`` (120) of the harder split (``demo.data.harder``: three operations, one more than
the demo's SFT has), none of them held out. The demo's own SFT model solves its two-operation problems
(99% greedy) and almost none of the harder split, and neither leaves RL anything it can raise in tens of
steps; the mixed SFT left a model that solves about half of the harder problems greedily and a third
by sampling (BENCHMARKS.md: the start moves with the CPU), wrong at its most likely answer on the
rest. From it, per RL seed and precision pair ``ROLLOUT:TRAINING`` (``fp8:blockwise``: FP8 rollouts from the FP8 export's weights, bf16 base dtype,
and FP8 blockwise training; ``high:bf16``: the high-precision pair), one ``infir2 rl`` run
(``OUT/rl/runs/<pair>-s<seed>``) on harder-split prompts with the collapse guard on (``rl/guard.py``:
held-out accuracy before step 1 and every ``eval_every`` steps, KL to the start model every step).
Then:

* ``OUT/rl/rl.png``: per pair, the rollout reward and the held-out accuracy over the steps (each seed
  thin, the mean thick) and the rollout/trainer mismatch (mean |dlogp| per step);
* the verdict, by the demo's interval rule (``infir2.tools.paired``, margin +-3 accuracy points):
  each pair's gain over the SFT start (held-out accuracy after the last step minus before the first,
  paired by RL seed), then the FP8 pair against the BF16 pair, paired by RL seed: its gain minus
  BF16's (does FP8 learn as much?) and its accuracy after RL minus BF16's (where it ends, the FP8
  export's loss at the start included);
* ``OUT/rl/results.json``: every run's curves and the verdicts.

Held-out accuracy is avg@8 at the rollout temperature (``train.eval_samples``: 8 samples per problem,
the same seeds at every evaluation) on harder-split problems generated apart from the prompts, the
quantity RL raises; greedy accuracy hides a sampled accuracy that falls (at lr 3e-4 it did, by 3
points). It is measured by the RL run's own engine: for the FP8 pair the FP8 export as deployed, for
the BF16 pair the high-precision model. The start is one model, so the intervals cover the RL seeds'
spread only. ``split`` (``two-op``, ``mixed``) and ``start_hard=0`` (the demo's own SFT model, reused
from OUT) give the earlier studies' settings (BENCHMARKS.md).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from .data import harder, make_conversations, make_problems
from .results import FULL, QUICK, DemoSettings
from .rl_results import report_text, rl_figure, study_verdicts, weight_views
from .workers import die_with_parent, start_worker

__all__ = ["QUICK_STUDY", "STUDY", "RLStudy", "run_rl_study"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RLStudy:
    """The RL showcase's settings (``STUDY`` is ``infir2 demo --rl``'s; ``QUICK_STUDY`` CI's)."""

    # RL seeds (sampler and prompt order); the start is one model. 16: at 8 the FP8 pair's spread (some
    # seeds barely learn) leaves both FP8 - BF16 lines inconclusive on this task (BENCHMARKS.md)
    seeds: tuple[int, ...] = tuple(range(16))
    pairs: tuple[str, ...] = ("fp8:blockwise", "high:bf16")  # ROLLOUT:TRAINING; the last is the reference
    sft_seed: int = 0  # the baseline's SFT run of the demo that RL starts from
    # the start's SFT length and peak lr; None: the demo's own (its baseline SFT is then reused when present)
    start_epochs: int | None = None
    start_lr: float | None = None
    # harder-split conversations mixed into the start's SFT (none of the held-out problems): SFT then
    # leaves the model partly able on that split, wrong at its most likely answer on some problems
    start_hard: int = 120
    steps: int = 40
    lr: float = 1e-4  # 3e-4 lowered the held-out avg@8 by 3 points (BF16 pair, 8 seeds)
    temperature: float = 1.0
    prompts_per_step: int = 16  # groups trained on per step (rollout.prompts_per_step)
    group_size: int = 8
    max_rounds: int = 2  # generation rounds of oversample x prompts_per_step prompts (dynamic sampling)
    oversample: int = 2  # prompts drawn per round, as a multiple of prompts_per_step
    base_dtype: str = "bf16"  # rollout.base_dtype of the fp8 pair (fp32: it quantizes as the trainer does)
    # hard: RL on (and measured on) the harder split; two-op: the SFT's own kind; mixed: half of each
    split: str = "hard"
    n_prompts: int = 1000  # RL prompts
    n_val: int = 100  # held-out problems
    eval_every: int = 10
    # held-out accuracy: None = greedy; k = avg@k, k samples per problem at the rollout temperature
    eval_samples: int | None = 8
    max_kl: float | None = 0.25  # guard.max_kl: a loose alarm (nats per token); keeps the KL logged


STUDY = RLStudy()
QUICK_STUDY = RLStudy(  # the quick demo's own SFT as the start
    seeds=(0, 1),
    start_hard=0,
    split="mixed",
    steps=2,
    prompts_per_step=2,
    group_size=4,
    n_prompts=16,
    n_val=8,
    eval_every=1,
)


def _problems(out: Path, s: DemoSettings, study: RLStudy) -> tuple[Path, Path]:
    """``OUT/rl/prompts.jsonl`` and ``OUT/rl/val.jsonl``. ``hard``: problems of the harder split, the
    held-out ones generated apart; ``two-op``: the demo's own two-operation problems (prompts: generated,
    none of ``test.jsonl``; held out: ``test.jsonl``'s first); ``mixed``: half of each file of either,
    so that a gain on the harder problems that costs the trained ones shows."""
    folder = out / "rl"
    folder.mkdir(parents=True, exist_ok=True)
    ops, m = harder(s.num_ops), s.max_operand
    share = {"hard": 1.0, "mixed": 0.5, "two-op": 0.0}[study.split]
    n_hard_val, n_hard = int(study.n_val * share), int(study.n_prompts * share)
    val = make_problems(n_hard_val, seed=s.data_seed + 2, num_ops=ops, prefix="rl-val", max_operand=m)
    test = [json.loads(x) for x in (out / "data" / "test.jsonl").read_text().splitlines() if x.strip()]
    held_out = [r["problem"] for r in val + test]
    prompts = make_problems(
        n_hard, seed=s.data_seed + 1, num_ops=ops, exclude=held_out, prefix="rl", max_operand=m
    )
    if study.split != "hard":
        val += test[: study.n_val - n_hard_val]
        prompts += make_problems(
            study.n_prompts - n_hard,
            seed=s.data_seed + 3,
            num_ops=s.num_ops,
            exclude=held_out,
            prefix="rl2",
            max_operand=m,
        )
    paths = folder / "prompts.jsonl", folder / "val.jsonl"
    for path, records in zip(paths, (prompts, val), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths


def start_model(out: Path, s: DemoSettings, study: RLStudy) -> Path:
    """The start: the demo's baseline SFT export at ``study.sft_seed``, reused from ``out`` or trained
    (CPT + SFT); with ``study.start_epochs`` / ``start_lr`` / ``start_hard``, an SFT of that length and
    lr, on the demo's conversations plus ``start_hard`` of the harder split, from the baseline's CPT
    (reused, or trained first) in ``OUT/runs/bf16/s<seed>/sft-<epochs>ep-lr<lr>[-hard<n>]``."""
    seed = study.sft_seed
    own = replace(s, sft_epochs=study.start_epochs or s.sft_epochs, sft_lr=study.start_lr or s.sft_lr)
    demo_own = own == s and not study.start_hard
    stage = "sft" if demo_own else f"sft-{own.sft_epochs}ep-lr{own.sft_lr:g}"
    stage += f"-hard{study.start_hard}" if study.start_hard else ""
    hf = out / "runs" / "bf16" / f"s{seed}" / stage / "hf"
    if (hf / "config.json").is_file():
        log.info("demo --rl: starting from %s (reused)", hf)
        if study.start_hard:
            _check_not_held_out(out, s, study)
        return hf
    from .pipeline import prepare_data, run_recipe, train_cpt, train_sft

    log.info("demo --rl: training the start (the baseline's CPT + SFT at seed %d) in %s", seed, out)
    data, tokenizer = prepare_data(out, s)
    if demo_own:
        run_recipe("bf16", seed, out, s, data, tokenizer, progress=False)
        return hf
    cpt = out / "runs" / "bf16" / f"s{seed}" / "cpt" / "hf"
    if not (cpt / "config.json").is_file():  # the CPT alone: the baseline's SFT is not needed
        train_cpt(s, out, "bf16", seed, tokenizer)
    if study.start_hard:
        data = dict(data, sft_train=_with_hard(out, s, study, data["sft_train"]))
    train_sft(own, out, "bf16", seed, cpt, data, tokenizer, stage)
    return hf


def _held_out(out: Path, s: DemoSettings, study: RLStudy) -> set[str]:
    """The study's held-out problems (``OUT/rl/val.jsonl``, written by ``_problems``)."""
    return {json.loads(x)["problem"] for x in _problems(out, s, study)[1].read_text().splitlines()}


def _mixed_sft_path(out: Path, study: RLStudy) -> Path:
    return out / "data" / f"sft_train_hard{study.start_hard}.jsonl"


def _check_not_held_out(out: Path, s: DemoSettings, study: RLStudy) -> None:
    """A reused mixed start was trained excluding the held-out problems of the study that made it; refuse
    it when this study holds out a problem its SFT saw (another ``n_val`` or ``split``)."""
    path = _mixed_sft_path(out, study)
    seen = [json.loads(x)["messages"][1]["content"] for x in path.read_text(encoding="utf-8").splitlines()]
    leaked = sorted(_held_out(out, s, study).intersection(seen))
    if leaked:
        raise ValueError(
            f"{path}: the reused start's SFT has {len(leaked)} of this study's held-out problems (first: "
            f"{leaked[0]!r}); it was trained for another held-out set (n_val, split): use a new --out"
        )


def _with_hard(out: Path, s: DemoSettings, study: RLStudy, sft: Path) -> Path:
    """``OUT/data/sft_train_hard<n>.jsonl``: the demo's SFT conversations and ``study.start_hard`` of the
    harder split (none of the study's held-out problems), shuffled together."""
    hard = make_conversations(
        study.start_hard, s.data_seed + 4, s.max_operand, harder(s.num_ops), exclude=_held_out(out, s, study)
    )
    lines = sft.read_text(encoding="utf-8").splitlines() + [json.dumps(c) for c in hard]
    random.Random(s.data_seed + 5).shuffle(lines)
    path = _mixed_sft_path(out, study)
    path.write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")
    return path


def _config(
    out: Path, hf: Path, paths: tuple[Path, Path], pair: str, seed: int, study: RLStudy, s: DemoSettings
) -> dict:
    rollout, recipe = pair.split(":")
    return {
        "run": {
            "name": f"{rollout}-{recipe}-s{seed}",
            "out_dir": str(out / "rl" / "runs"),
            "seed": seed,
            "device": "cpu",
        },
        "model": {"path": str(hf), "precision": "fp32"},
        "fp8": {"recipe": recipe},
        "optim": {"lr": study.lr},
        "data": {"prompts_path": str(paths[0]), "val_path": str(paths[1])},
        "rollout": {
            "precision": rollout,
            "base_dtype": study.base_dtype,
            "prompts_per_step": study.prompts_per_step,
            "group_size": study.group_size,
            "oversample_prompts": study.oversample * study.prompts_per_step,
            "max_rounds": study.max_rounds,
            "max_new_tokens": s.max_new_tokens,
            "temperature": study.temperature,
            "batch_size": 128,
        },
        "algo": {"updates_per_batch": 1, "micro_batch_size": 64},
        "train": {
            "max_steps": study.steps,
            "save_every": 0,
            "log_every": 5,
            "eval_every": study.eval_every,
            "eval_samples": study.eval_samples,
        },
        "guard": {"max_kl": study.max_kl},
    }


def _worker_run(cfg: dict, threads: int) -> dict[str, Any]:
    """``_one_run`` in a worker process: its threads and tagged log lines first (never in the caller's
    process, whose logging and threads stay as they were)."""
    start_worker(threads, cfg["run"]["name"])
    return _one_run(cfg)


def _one_run(cfg: dict) -> dict[str, Any]:
    """One RL run (in a worker process, or here): its curves from ``metrics.jsonl`` and ``guard.json``."""
    from ...harness.config_changes import reconcile_saved_config
    from ...rl import parse_rl_config, rl
    from ...rl.config import MEANINGFUL

    parsed = parse_rl_config(cfg, f"demo --rl:{cfg['run']['name']}")
    run_dir = parsed.run_dir
    if _finished(run_dir, parsed.train.max_steps):  # a rerun of the study reads a finished run back ...
        reconcile_saved_config(parsed, MEANINGFUL, write=False)  # ... if it ran these settings (else refused)
    else:
        run_dir = rl(parsed, progress=False).run_dir
    history = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    guard = json.loads((run_dir / "guard.json").read_text())
    val = [(0, guard["val_start"])] + [(m["step"], m["val_accuracy"]) for m in history if "val_accuracy" in m]
    return {
        "steps": [m["step"] for m in history],
        "reward": [m["reward_mean"] for m in history],
        "val": val,
        "kl_ref": [m.get("kl_ref", 0.0) for m in history],
        "abs_dlogp_mean": [m.get("mismatch/abs_dlogp_mean", 0.0) for m in history],
        "abs_dlogp_max": [m.get("mismatch/abs_dlogp_max", 0.0) for m in history],
        "prob_error": [m.get("mismatch/prob_error", 1.0) for m in history],
        "guard": guard["trips"],
        "seconds": sum(m["step_time_s"] for m in history),
        "weight_views": weight_views(Path(cfg["model"]["path"]), run_dir / "hf"),
    }


def _finished(run_dir: Path, steps: int) -> bool:
    """The run exported ``hf/`` after ``steps`` steps (and recorded its guard): nothing left to compute."""
    metrics, guard = run_dir / "metrics.jsonl", run_dir / "guard.json"
    if not ((run_dir / "hf" / "config.json").is_file() and metrics.is_file() and guard.is_file()):
        return False
    lines = [x for x in metrics.read_text().splitlines() if x.strip()]
    return bool(lines) and json.loads(lines[-1])["step"] == steps


def run_rl_study(
    out: Path,
    quick: bool = False,
    study: RLStudy | None = None,
    jobs: int = 1,
    settings: DemoSettings | None = None,
) -> dict[str, Any]:
    """The whole showcase (module doc): start, runs side by side in ``jobs`` processes, figure, verdict.
    ``settings``: the demo's (data, CPT, SFT) when not ``FULL`` / ``QUICK``."""
    t0 = time.perf_counter()
    s = settings or (QUICK if quick else FULL)
    study = study or (QUICK_STUDY if quick else STUDY)
    hf = start_model(out, s, study)
    paths = _problems(out, s, study)
    keys = [(p, seed) for seed in study.seeds for p in study.pairs]
    configs = {k: _config(out, hf, paths, k[0], k[1], study, s) for k in keys}
    jobs = max(1, min(jobs, len(keys)))
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else 1
    log.info(
        "demo --rl: %d RL runs (%d seeds x %d pairs), %d at a time",
        len(keys),
        len(study.seeds),
        len(study.pairs),
        jobs,
    )
    if jobs == 1:  # here, at a worker's thread count (the same numbers for any --jobs), then as it was
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            runs = _every_run({k: partial(_one_run, configs[k]) for k in keys}, configs)
        finally:
            torch.set_num_threads(before)
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            jobs, mp_context=context, initializer=die_with_parent, initargs=(os.getpid(),)
        ) as pool:
            futures = {k: pool.submit(_worker_run, configs[k], threads) for k in keys}
            runs = _every_run({k: f.result for k, f in futures.items()}, configs)
    verdicts = study_verdicts(runs, study.pairs)
    record = {
        "study": asdict(study),
        "start": str(hf),
        "seconds": time.perf_counter() - t0,
        "runs": [{"pair": p, "seed": seed, **runs[p, seed]} for p, seed in keys],
        "verdicts": verdicts,
    }
    (out / "rl" / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    rl_figure(record, out / "rl" / "rl.png")
    print(report_text(record))
    return record


def _every_run(
    results: dict[tuple[str, int], Callable[[], dict[str, Any]]], configs: dict[tuple[str, int], dict]
) -> dict[tuple[str, int], dict[str, Any]]:
    """Each run's result (``results[key]()``: the run itself, or its future's ``result``), all of them
    before any failure is raised: a run that fails leaves the others to finish (each writes its own
    folder, and a rerun of the study reads the finished ones back, ``_one_run``). Every failed run is
    logged by name and folder; then the first failure is raised."""
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    failed: dict[tuple[str, int], Exception] = {}
    for key, result in results.items():
        try:
            runs[key] = result()
        except Exception as e:
            failed[key] = e
            log.error("demo --rl: run %s failed: %s: %s", configs[key]["run"]["name"], type(e).__name__, e)
    if failed:
        names = ", ".join(str(Path(configs[k]["run"]["out_dir"]) / configs[k]["run"]["name"]) for k in failed)
        log.error(
            "demo --rl: %d of %d RL runs failed (%s). The %d others are finished and kept: the same command "
            "again reads them back and retries the failed ones.",
            len(failed),
            len(results),
            names,
            len(runs),
        )
        raise next(iter(failed.values()))
    return runs
