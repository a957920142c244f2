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
``step_time_s`` (wall clock), the process CPU seconds of the rollout, the rescoring and the step (one
thread: on cores other jobs share, the CPU time is the steadier measure), and the largest
``mismatch/abs_dlogp_max`` of the steps (0 with rescoring: the ratios are exactly 1); then the step's
ratio with / without and rescoring's share of the step it is in.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' tiny builders

from rl_step_memory import write_prompts

from infir2.tools.machine import cpu_description

#: ``--pair``: the rollout and fp8 sections of an identical pair
PAIRS = {
    "fp8": ({"precision": "fp8", "base_dtype": "fp32"}, {"recipe": "blockwise"}),
    "high": ({"precision": "high"}, {"recipe": "bf16"}),
}
PHASES = ("rollout_time_s", "rescore_time_s", "train_time_s", "step_time_s")
CPU = ("rollout_cpu_s", "rescore_cpu_s", "step_cpu_s")


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
    cpu: list[dict[str, float]] = []
    with cpu_timed(cpu):
        history = rl(cfg, model=model, tokenizer=make_tokenizer(), progress=False).history
    return [m | {f"{k}_cpu_s": v for k, v in c.items()} for m, c in zip(history, cpu, strict=True)]


@contextmanager
def cpu_timed(per_step: list[dict[str, float]]) -> Iterator[None]:
    """Inside: each RL step's process CPU seconds (``time.process_time``: one thread, so what the other
    jobs on the cores take does not count) of the step, its rollout and its rescoring, appended to
    ``per_step``."""
    from infir2.rl import loop as rl_loop

    real = {"step": rl_loop._step, "rollout": rl_loop.collect_groups, "rescore": rl_loop.rescore}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any) -> Any:
            if name == "step":
                per_step.append({"rollout": 0.0, "rescore": 0.0})
            t = time.process_time()
            out = fn(*a)
            per_step[-1][name] = per_step[-1].get(name, 0.0) + time.process_time() - t
            return out

        return wrapper

    rl_loop._step, rl_loop.collect_groups, rl_loop.rescore = (timed(k, fn) for k, fn in real.items())
    try:
        yield
    finally:
        rl_loop._step, rl_loop.collect_groups, rl_loop.rescore = real.values()


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
    print(f"# {cpu_description()}; torch {torch.__version__}; OMP_NUM_THREADS={threads}")
    print(f"# {' '.join(sys.argv)}")
    steps: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        write_prompts(out / "prompts.jsonl")
        for k in range(args.repeats):
            for rescore in (False, True):
                history = run_variant(args, rescore, out, f"{'on' if rescore else 'off'}{k}")
                steps[rescore] += history[1:]
    mean = {
        v: {key: statistics.mean(m.get(key, 0.0) for m in s) for key in PHASES + CPU}
        for v, s in steps.items()
    }
    print(
        "| rescore | steps | tokens / step | rollout s | rescore s | score + update s | step s | "
        "CPU s: rollout / rescore / step | max abs dlogp |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for v, s in steps.items():
        m = mean[v]
        tokens = statistics.mean(x["response_tokens"] for x in s)
        worst = max(x["mismatch/abs_dlogp_max"] for x in s)
        print(
            f"| {'on' if v else 'off'} | {len(s)} | {tokens:.0f} | {m['rollout_time_s']:.3f} | "
            f"{m['rescore_time_s']:.3f} | {m['train_time_s'] - m['rescore_time_s']:.3f} | "
            f"{m['step_time_s']:.3f} | {m['rollout_cpu_s']:.3f} / {m['rescore_cpu_s']:.3f} / "
            f"{m['step_cpu_s']:.3f} | {worst:.2e} |"
        )
    off, on = mean[False], mean[True]
    print(
        f"with / without: step {on['step_time_s'] / off['step_time_s']:.3f}x wall, "
        f"{on['step_cpu_s'] / off['step_cpu_s']:.3f}x CPU; rescoring's share of the step with it: "
        f"{on['rescore_time_s'] / on['step_time_s']:.3f} wall, {on['rescore_cpu_s'] / on['step_cpu_s']:.3f} CPU; "
        f"rescore / rollout: {on['rescore_cpu_s'] / on['rollout_cpu_s']:.3f} CPU"
    )


if __name__ == "__main__":
    main()
