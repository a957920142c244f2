"""The cost of ``rollout.rescore`` per ``infir2 rl`` step, side by side with the same run without it.

    OMP_NUM_THREADS=1 python benchmarks/rl_rescore_cost.py
    OMP_NUM_THREADS=1 python benchmarks/rl_rescore_cost.py --hidden 256 --layers 4 --vocab 32000 \
        --group 8 --max-new-tokens 128 --steps 4 --repeats 2

Each variant runs ``--steps`` RL steps (``infir2.rl.rl``) of one prompt with a group of ``--group``
responses of up to ``--max-new-tokens`` tokens on a random tiny Qwen2 (``tests/conftest.make_tiny_model``:
``--layers`` layers of width ``--hidden``, ``--vocab`` words; a random model seldom samples a stop token,
so the responses run to the budget), fp32 on the CPU, the micro-batch the whole group, no reference
model. The pair is an identical one: ``--pair fp8`` FP8 rollouts of the trainer's base tensors
(``rollout.base_dtype: fp32``) with ``blockwise`` training, ``--pair high`` high-precision rollouts and
training. The variants alternate (off, on, off, on, ...: ``--repeats`` of each) in one process, so a
load that drifts over the run touches both.

Per variant, the mean over every step but each run's first (the warm-up) of ``rollout_time_s`` (the
generation), ``rescore_time_s`` (the extra forward), ``train_time_s`` (rescoring, scoring, the update) and
``step_time_s``; then the ratios of the step and of the rollout-plus-rescore to the run without, and
the largest ``mismatch/abs_dlogp_max`` of the steps (0 with rescoring: the ratios are exactly 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' tiny builders

from rl_step_memory import cpu_line, write_prompts

#: ``--pair``: the rollout and fp8 sections of an identical pair
PAIRS = {
    "fp8": ({"precision": "fp8", "base_dtype": "fp32"}, {"recipe": "blockwise"}),
    "high": ({"precision": "high"}, {"recipe": "bf16"}),
}
PHASES = ("rollout_time_s", "rescore_time_s", "train_time_s", "step_time_s")


def run_variant(args: argparse.Namespace, rescore: bool, out: Path, name: str) -> list[dict]:
    """One run of ``args.steps`` steps; its metrics per step."""
    from conftest import make_tiny_model, make_tokenizer
    from infir2.rl import rl
    from rl_runs import one_step_config

    rollout, fp8 = PAIRS[args.pair]
    cfg = one_step_config(
        out,
        out / "prompts.jsonl",
        name,
        args.group,
        args.max_new_tokens,
        kl_coef=0.0,
        rollout={**rollout, "rescore": rescore},
        fp8=fp8,
        train={"max_steps": args.steps, "save_every": 0},
        model={"beyond_context": True},
    )
    model = make_tiny_model(
        vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, max_positions=args.max_new_tokens + 64
    )
    return rl(cfg, model=model, tokenizer=make_tokenizer(), progress=False).history


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=sorted(PAIRS), default="fp8")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--group", type=int, default=8, help="responses per step (one prompt)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is not counted)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each variant, alternating")
    args = p.parse_args()
    if args.steps < 2:
        p.error(f"--steps: at least 2 (the first step of a run is not counted), got {args.steps}")
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    print(f"# {cpu_line()}; torch {torch.__version__}; OMP_NUM_THREADS={threads}")
    print(f"# {' '.join(sys.argv)}")
    steps: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        write_prompts(out / "prompts.jsonl")
        for k in range(args.repeats):
            for rescore in (False, True):
                history = run_variant(args, rescore, out, f"{'on' if rescore else 'off'}{k}")
                steps[rescore] += history[1:]
    mean = {v: {key: statistics.mean(m.get(key, 0.0) for m in s) for key in PHASES} for v, s in steps.items()}
    print(
        "| rescore | steps | tokens / step | rollout s | rescore s | score + update s | step s | max abs dlogp |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for v, s in steps.items():
        m = mean[v]
        tokens = statistics.mean(x["response_tokens"] for x in s)
        worst = max(x["mismatch/abs_dlogp_max"] for x in s)
        print(
            f"| {'on' if v else 'off'} | {len(s)} | {tokens:.0f} | {m['rollout_time_s']:.3f} | "
            f"{m['rescore_time_s']:.3f} | {m['train_time_s'] - m['rescore_time_s']:.3f} | "
            f"{m['step_time_s']:.3f} | {worst:.2e} |"
        )
    off, on = mean[False], mean[True]
    print(
        f"step time with / without: {on['step_time_s'] / off['step_time_s']:.3f}x; "
        f"rescore / rollout (with): {on['rescore_time_s'] / on['rollout_time_s']:.3f}"
    )


if __name__ == "__main__":
    main()
