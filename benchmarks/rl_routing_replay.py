"""Routing replay on and off: `infir2 rl` on the shipped tiny MoE, the rollout / trainer mismatch side by side.

    python benchmarks/rl_routing_replay.py --out /tmp/rl-replay [--seeds 0,1,2 --steps 4]

The model is ``tiny-moe-cpt``'s (``model.from_config`` of the shipped config: a 2-layer Qwen3-MoE, 8
experts, top-2), built from scratch with each seed (random weights: no training before RL), with the
demo's tokenizer and its held-out math problems as prompts (``infir2 demo --data-only --quick`` writes
them under ``--out`` first). Per seed, two runs that differ only in ``algo.routing_replay`` (off |
rollout): FP8 rollouts (``rollout.precision: fp8``, ``rollout.base_dtype`` as given: bf16, the deployed
model, by default), blockwise FP8 training with blockwise experts, no dynamic sampling (an untrained
model gets every reward 0). Step 1 of both runs scores the same rollouts with the same weights, so it
is a paired comparison; the later steps differ by the updates too, and are shown as a mean. Printed:
the CPU, the torch version, the commit, then per seed the step-1 mismatch (``mismatch/abs_dlogp_mean``,
``mismatch/k3_kl``, ``mismatch/prob_error`` - 1) without and with replay and their ratio, the share of
tokens whose experts the trainer would have chosen differently (``routing/differ_share``, from the
replay run), and the same over all steps.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from statistics import mean

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from infir2.tools.machine import cpu_description  # the CPU line every benchmark prints
from infir2.tools.recipe_spec import int_list

KEYS = ("mismatch/abs_dlogp_mean", "mismatch/k3_kl", "mismatch/prob_error")


def _config(args: argparse.Namespace, data: Path, seed: int, replay: str) -> dict:
    from infir2.harness.config import resolve_config_path

    model = yaml.safe_load(resolve_config_path("tiny-moe-cpt").read_text())["model"]
    model["tokenizer"] = str(data / "tokenizer")
    return {
        "run": {
            "name": f"s{seed}-{replay}",
            "out_dir": str(args.out / "runs"),
            "seed": seed,
            "device": "cpu",
        },
        "model": model,
        "fp8": {"recipe": "blockwise"},
        "optim": {"lr": 1e-4},
        "data": {"prompts_path": str(data / "data" / "test.jsonl")},
        "rollout": {
            "precision": "fp8",
            "base_dtype": args.base_dtype,
            "prompts_per_step": args.prompts,
            "group_size": args.group,
            "oversample_prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "batch_size": args.prompts * args.group,
        },
        "algo": {"dynamic_sampling": False, "micro_batch_size": args.group * 2, "routing_replay": replay},
        "train": {"max_steps": args.steps, "save_every": 0},
    }


def _run(args: argparse.Namespace, data: Path, seed: int, replay: str) -> list[dict]:
    from infir2.rl import parse_rl_config, rl

    cfg = parse_rl_config(_config(args, data, seed, replay), f"<seed {seed}, replay {replay}>")
    return rl(cfg, progress=False).history


def _row(label: str, off: list[dict], on: list[dict]) -> str:
    cells = []
    for key in KEYS:
        a, b = (mean(m[key] - (key == KEYS[2]) for m in h) for h in (off, on))
        cells.append(f"{a:.3e} | {b:.3e} | {b / a if a else float('nan'):.3f}")
    return f"| {label} | " + " | ".join(cells) + f" | {mean(m['routing/differ_share'] for m in on):.4f} |"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--base-dtype", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args()
    try:
        seeds = int_list(args.seeds, "--seeds", "seed")  # empty entries and a seed given twice refused
    except ValueError as e:
        parser.error(str(e))
    torch.set_num_threads(1)
    data = args.out / "tiny"
    if not (data / "tokenizer").is_dir():
        from infir2.cli import main as cli

        assert cli(["demo", "--data-only", "--quick", "--out", str(data)]) == 0
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(f"CPU: {cpu_description()}; torch {torch.__version__}; commit {commit}")
    print(
        f"FP8 rollouts (base_dtype {args.base_dtype}), blockwise training; {args.prompts} prompts x {args.group}"
    )
    print(f"samples, up to {args.max_new_tokens} tokens, {args.steps} steps per run\n")
    head = " | ".join(f"{k.split('/')[1]} off | on | on/off" for k in KEYS)
    print(f"| seed, steps | {head} | routes differed |")
    print("|---" * (2 + 3 * len(KEYS)) + "|")
    rows = []
    for seed in seeds:
        off, on = _run(args, data, seed, "off"), _run(args, data, seed, "rollout")
        rows.append((off, on))
        print(_row(f"{seed}, step 1 (paired)", off[:1], on[:1]))
        print(_row(f"{seed}, all {args.steps}", off, on), flush=True)
    print(_row("all seeds, step 1 (paired)", [r[0][0] for r in rows], [r[1][0] for r in rows]))
    print("(prob_error is shown as prob_error - 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
