"""RL after the demo's SFT: held-out accuracy of the SFT model vs the same model after `infir2 rl`.

    python benchmarks/rl_demo.py --out /tmp/rl-demo --sft-seed 0 --seeds 0,1 --pairs fp8:blockwise,bf16:bf16

The demo's data, tokenizer, CPT and SFT at ``--sft-seed`` (``infir2.tools.demo.pipeline.run_recipe`` with the
full demo settings, baseline recipe; reused when ``--out`` already holds them), the SFT model's greedy
accuracy on the held-out test problems (the demo's own evaluation), then per RL seed (``run.seed``:
the sampler and the prompt order) and precision pair ``ROLLOUT:TRAINING`` an RL run from the SFT model (``infir2.rl.rl``; prompts: the SFT training
problems as ``{"problem", "answer"}``; test problems are never trained on) and the same evaluation of
its ``hf/`` export. Prints one table: accuracy before and after, the gain in points, the mismatch
the run measured, and the RL run's wall-clock time.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from infir2.eval import evaluate, load_problems
from infir2.rl import parse_rl_config, rl
from infir2.tools.demo.pipeline import FULL, prepare_data, run_recipe


def _accuracy(model_dir: Path, tokenizer, test: Path, sampled: bool = False) -> float:
    """Greedy accuracy, or (``sampled``) avg@4 at the protocol's temperature 0.65 / top-p 0.95 (seed 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).float().eval()
    problems = load_problems(test, "math")
    how = (
        {"n": 4, "greedy": False, "temperature": 0.65, "top_p": 0.95, "seed": 0}
        if sampled
        else {"greedy": True}
    )
    result = evaluate(
        model,
        tokenizer,
        problems,
        task="math",
        max_new_tokens=FULL.max_new_tokens,
        batch_size=FULL.eval_batch_size,
        progress=False,
        **how,
    )
    return float(result.summary["avg@n"])


def _prompts(sft_train: Path, out: Path) -> Path:
    """The SFT conversations' problems and boxed answers, as an RL prompts file."""
    with out.open("w") as f:
        for line in sft_train.read_text().splitlines():
            messages = json.loads(line)["messages"]
            answer = re.search(r"\\boxed\{([^}]*)\}", messages[-1]["content"])
            assert answer is not None
            f.write(json.dumps({"problem": messages[1]["content"], "answer": answer.group(1)}) + "\n")
    return out


def _rl_config(out: Path, sft_hf: Path, prompts: Path, rollout: str, recipe: str, seed: int, args) -> dict:
    return {
        "run": {
            "name": f"rl-{rollout}-{recipe}-s{seed}{args.name}",
            "out_dir": str(out / "runs"),
            "seed": seed,
            "device": "cpu",
        },
        "model": {"path": str(sft_hf), "precision": "fp32"},
        "fp8": {"recipe": recipe},
        "optim": {"lr": args.lr},
        "data": {"prompts_path": str(prompts)},
        "rollout": {
            "precision": rollout,
            "prompts_per_step": args.prompts,
            "group_size": args.group,
            "oversample_prompts": 2 * args.prompts,
            "max_new_tokens": FULL.max_new_tokens,
            "temperature": args.temperature,
            "batch_size": 128,
        },
        "algo": {"updates_per_batch": args.updates, "micro_batch_size": 64},
        "train": {"max_steps": args.steps, "save_every": 0, "log_every": 5},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--sft-seed", type=int, default=0, help="seed of the CPT + SFT start (shared by every RL run)"
    )
    p.add_argument("--seeds", default="0", help="RL seeds")
    p.add_argument("--pairs", default="fp8:blockwise,bf16:bf16", help="ROLLOUT:TRAINING precision pairs")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--updates", type=int, default=2, help="optimizer steps per rollout batch")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--temperature", type=float, default=1.0, help="rollout temperature (the policy is logits / T)"
    )
    p.add_argument("--name", default="", help="suffix of the RL run folders (several settings side by side)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)  # one thread: tiny GEMMs on a shared CPU (more only spin)
    data, tokenizer = prepare_data(args.out, FULL)
    prompts = _prompts(data["sft_train"], args.out / "rl_prompts.jsonl")
    rows = []
    sft_hf = args.out / "runs" / "bf16" / f"s{args.sft_seed}" / "sft" / "hf"
    if not (sft_hf / "config.json").is_file():
        run_recipe("bf16", args.sft_seed, args.out, FULL, data, tokenizer, progress=False)
    before = (
        _accuracy(sft_hf, tokenizer, data["test"]),
        _accuracy(sft_hf, tokenizer, data["test"], sampled=True),
    )
    print(
        f"SFT (seed {args.sft_seed}): greedy {100 * before[0]:.1f}%, avg@4 {100 * before[1]:.1f}% on "
        f"{FULL.n_test} held-out problems",
        flush=True,
    )
    for seed in (int(s) for s in args.seeds.split(",")):
        for pair in args.pairs.split(","):
            rollout, recipe = pair.split(":")
            cfg = parse_rl_config(
                _rl_config(args.out, sft_hf, prompts, rollout, recipe, seed, args), "rl_demo"
            )
            result = rl(cfg, progress=False)
            assert result.hf_dir is not None
            after = (
                _accuracy(result.hf_dir, tokenizer, data["test"]),
                _accuracy(result.hf_dir, tokenizer, data["test"], sampled=True),
            )
            history = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
            dlogp = sum(m.get("mismatch/abs_dlogp_mean", 0.0) for m in history) / len(history)
            seconds = sum(
                m["step_time_s"] for m in history
            )  # the RL steps (a rerun of a finished run: theirs)
            first, last = (
                sum(m["accuracy"] for m in part) / len(part) for part in (history[:5], history[-5:])
            )
            row = (seed, pair, before, after, first, last, dlogp, seconds)
            rows.append(row)
            print(_row(row), flush=True)
    print(
        "\n| RL seed | rollout:training | greedy: SFT -> RL | gain | avg@4 (T 0.65): SFT -> RL | gain | "
        f"rollout accuracy (T {args.temperature}), steps 1-5 -> last 5 | mean abs dlogp | RL steps time |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(_row(row))


def _row(row: tuple) -> str:
    seed, pair, before, after, first, last, dlogp, seconds = row
    return (
        f"| {seed} | {pair} | {100 * before[0]:.0f}% -> {100 * after[0]:.0f}% | {100 * (after[0] - before[0]):+.0f} | "
        f"{100 * before[1]:.1f}% -> {100 * after[1]:.1f}% | {100 * (after[1] - before[1]):+.1f} | "
        f"{100 * first:.1f}% -> {100 * last:.1f}% | {dlogp:.1e} | {seconds:.0f} s |"
    )


if __name__ == "__main__":
    main()
