"""Crash-safety trials: `infir2 train` killed with SIGKILL at random moments, rerun until it finishes.

Builds the demo's data (tokenizer, CPT token shards, SFT conversations), runs each stage once
uninterrupted as the reference, then for every trial starts the same command in a fresh run folder,
kills it (``kill -9``) after a random delay -- during a step, a checkpoint write, the final export --
and reruns the command (up to ``--kills`` kills per trial) until it exits 0. A trial passes when its
``metrics.jsonl`` losses and its final checkpoint's model and optimizer tensors are bit-identical to
the reference and no ``.tmp-*`` folder is left in the checkpoints. Prints one line per trial and a
summary; exit code 1 if any trial differs.

    python benchmarks/kill_resume.py --trials 6 --out /tmp/kill_trials
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from infir2.checkpoint import latest_checkpoint, load_checkpoint
from infir2.data.cpt import prepare_cpt
from infir2.data.tokenizer import train_bpe_tokenizer
from infir2.tools.demo.data import make_demo_data, tokenizer_training_texts
from train_synthetic import cpt_data, tiny_llama


def _configs(root: Path) -> dict[str, dict]:
    data = make_demo_data(root / "data", n_train=200, n_test=10, n_cpt_worked=300, n_cpt_tables=100)
    tokenizer = train_bpe_tokenizer(tokenizer_training_texts(data), 400)
    tokenizer.save_pretrained(root / "tokenizer")
    prepare_cpt([data["cpt"]], root / "cpt", tokenizer, val_fraction=0.05, progress=False)
    common = {"optim": {"lr": 3e-3}, "fp8": {"recipe": "blockwise"}}
    cpt = {
        **common,
        "run": {"name": "cpt", "device": "cpu"},
        "model": {"from_config": tiny_llama(), "tokenizer": str(root / "tokenizer"), "precision": "fp32"},
        "data": cpt_data(root / "cpt", 64, 8, 4),
        "schedule": {"name": "wsd", "warmup_steps": 2, "decay_steps": 4},
        "train": {"max_steps": 12, "save_every": 3, "keep_last": 2, "eval_every": 6, "eval_batches": 2},
    }
    sft = {
        **common,
        "run": {"name": "sft", "device": "cpu"},
        "model": {"from_config": tiny_llama(), "tokenizer": str(root / "tokenizer"), "precision": "fp32"},
        "data": {
            "kind": "sft",
            "train_path": str(data["sft_train"]),
            "global_batch_size": 8,
            "max_tokens_per_micro_batch": 512,
            "max_length": 256,
        },
        "schedule": {"name": "cosine", "warmup_fraction": 0.1},
        "train": {"max_steps": 10, "save_every": 2, "keep_last": 2},
    }
    return {"cpt": cpt, "sft": sft}


def _run(cfg: dict, out_dir: Path, kill_after: float | None) -> int | None:
    """Run `infir2 train` in a subprocess; SIGKILL it after ``kill_after`` s. Returns its exit code, None if killed."""
    path = out_dir / "config.yaml.in"
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = {**cfg, "run": {**cfg["run"], "out_dir": str(out_dir)}}
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "infir2.cli", "train", str(path), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=kill_after)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return None
    if proc.returncode != 0:
        print(err[-2000:], file=sys.stderr)
    return proc.returncode


def _fingerprint(run_dir: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    state = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    tensors = {f"model.{k}": v for k, v in state["model"].items()}
    for pid, per_param in state["optimizer"]["state"].items():
        for k, v in per_param.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim.{pid}.{k}"] = v
    return losses, tensors


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=6, help="trials per stage (CPT and SFT)")
    parser.add_argument("--kills", type=int, default=2, help="kills per trial before the final rerun")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("kill_trials"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    shutil.rmtree(args.out, ignore_errors=True)
    configs = _configs(args.out)
    total = identical = 0
    for stage, cfg in configs.items():
        t0 = time.perf_counter()
        assert _run(cfg, args.out / "ref" / stage, None) == 0, f"reference {stage} run failed"
        wall = time.perf_counter() - t0
        ref = _fingerprint(args.out / "ref" / stage / cfg["run"]["name"])
        for trial in range(args.trials):
            out = args.out / f"{stage}-{trial}"
            delays = [rng.uniform(0.1, 0.6) * wall for _ in range(args.kills)]
            killed = sum(_run(cfg, out, d) is None for d in delays)
            rc = _run(cfg, out, None)
            run_dir = out / cfg["run"]["name"]
            losses, tensors = _fingerprint(run_dir)
            same = (
                rc == 0
                and losses == ref[0]
                and tensors.keys() == ref[1].keys()
                and all(torch.equal(tensors[k], ref[1][k]) for k in tensors)
            )
            leftovers = [p.name for p in (run_dir / "checkpoints").glob(".tmp-*")]
            ok = same and not leftovers
            total, identical = total + 1, identical + ok
            print(
                f"{stage} trial {trial}: killed {killed}x at {', '.join(f'{d:.1f}s' for d in delays)} "
                f"(uninterrupted {wall:.1f}s); final rc {rc}; "
                f"{'bit-identical' if same else 'DIFFERS'}{'; leftovers ' + str(leftovers) if leftovers else ''}",
                flush=True,
            )
    print(f"{identical}/{total} trials finished bit-identical to the uninterrupted runs")
    return 0 if identical == total else 1


if __name__ == "__main__":
    sys.exit(main())
