"""Crash-safety trials for `infir2 rl`: killed with SIGKILL at random moments, rerun until it finishes.

    python benchmarks/rl_kill_resume.py --model /tmp/rl-demo/runs/bf16/s0/sft/hf \\
        --prompts /tmp/rl-demo/rl_prompts.jsonl --trials 3 --out /tmp/rl-kill

Runs a small RL config (FP8 rollouts, blockwise training, a checkpoint every step, dynamic sampling
with carry-over, so the buffer crosses checkpoints) once uninterrupted as the reference, then per trial
starts the same command in a fresh run folder, kills it (``kill -9``) after a random share of the
reference's wall time -- during generation, an update, a checkpoint write or the export -- and reruns
it (``--kills`` kills per trial) until it exits 0. A trial passes when every line of its
``metrics.jsonl`` (timings left out) and every tensor of its final checkpoint (model, AdamW) equal the
reference's bit for bit and no ``.tmp-*`` folder is left. Exit code 1 if any trial differs.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the RL tests' run fingerprint
from rl_runs import fingerprint


def _config(model: str, prompts: str, out: Path, name: str) -> dict:
    return {
        "run": {"name": name, "out_dir": str(out), "seed": 0, "device": "cpu"},
        "model": {"path": model, "precision": "fp32"},
        "fp8": {"recipe": "blockwise"},
        "optim": {"lr": 2e-5},
        "data": {"prompts_path": prompts},
        "rollout": {
            "prompts_per_step": 4,
            "group_size": 4,
            "oversample_prompts": 6,
            "max_new_tokens": 64,
            "batch_size": 32,
            "carry_over": True,
        },
        "algo": {"updates_per_batch": 2},
        "train": {"max_steps": 6, "save_every": 1, "keep_last": 2},
    }


def _run(cfg: dict, path: Path, kill_after: float | None) -> int | None:
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "infir2.cli", "rl", str(path), "--no-progress"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", **_pythonpath()},
    )
    try:
        _, err = proc.communicate(timeout=kill_after)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
    if proc.returncode:
        raise SystemExit(f"infir2 rl failed:\n{err[-3000:]}")
    return proc.returncode


def _pythonpath() -> dict[str, str]:
    import infir2

    return {"PYTHONPATH": str(Path(infir2.__file__).parents[1])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--kills", type=int, default=2, help="kills per trial before the final rerun")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("rl_kill_trials"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    _run(_config(args.model, args.prompts, args.out, "reference"), args.out / "reference.yaml", None)
    wall = time.perf_counter() - t0
    ref_metrics, ref_tensors = fingerprint(args.out / "reference")
    rng = random.Random(args.seed)
    failed = 0
    for trial in range(args.trials):
        name = f"trial{trial}"
        cfg = _config(args.model, args.prompts, args.out, name)
        delays = [rng.uniform(0.2, 0.9) * wall for _ in range(args.kills)]
        killed = sum(_run(cfg, args.out / f"{name}.yaml", d) is None for d in delays)
        _run(cfg, args.out / f"{name}.yaml", None)
        metrics, tensors = fingerprint(args.out / name)
        same = (
            metrics == ref_metrics
            and tensors.keys() == ref_tensors.keys()
            and all(torch.equal(tensors[k], ref_tensors[k]) for k in tensors)
        )
        leftovers = list((args.out / name / "checkpoints").glob(".tmp-*"))
        ok = same and not leftovers
        failed += not ok
        print(
            f"trial {trial}: killed {killed}x at {', '.join(f'{d:.1f}s' for d in delays)} "
            f"(reference {wall:.1f}s): {'bit-identical' if same else 'DIFFERS'}, "
            f"{len(leftovers)} leftover .tmp folders",
            flush=True,
        )
    print(f"{args.trials - failed}/{args.trials} trials bit-identical to the uninterrupted run")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
