"""The planner's table of issue 56: the FP8 stack against BF16, per model, context, GPUs and checkpointing.

For Qwen2.5-1.5B and 7B, 8k and 32k tokens, 1 and 8 GPUs, activation checkpointing off and on (micro-batch
1), the planned peak GiB per GPU of: "usual" -- BF16 with fp32 moments and gradients (what most runs
use); "same" -- BF16 with the stack's optimizer options; "stack" -- FP8 blockwise with FP8 moments
(``optim.state_dtype: fp8``) and, on one GPU, bf16 gradients (``optim.grad_dtype: bf16``); and the two
ratios. Printed as a Markdown table (BENCHMARKS.md, "Memory where users run it").

    PYTHONPATH=src python benchmarks/plan_fp8_stack.py
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from infir2.planning import PlanInputs, load_shape, plan_step

GIB = 2**30


def main() -> None:
    print("| model | context | GPUs | AC | usual | same | stack | stack / usual | stack / same |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, seq, gpus, ac in itertools.product(
        ("qwen2.5-1.5b", "qwen2.5-7b"), (8192, 32768), (1, 8), (False, True)
    ):
        _, shape = load_shape(model)
        grads = "bf16" if gpus == 1 else "fp32"
        run = PlanInputs(
            "blockwise",
            gpus=gpus,
            seq_len=seq,
            activation_checkpointing=ac,
            state_dtype="fp8",
            grad_dtype=grads,
        )
        stack = plan_step(shape, run).peak
        same = plan_step(shape, replace(run, recipe="bf16")).peak
        usual = plan_step(shape, replace(run, recipe="bf16", state_dtype="fp32", grad_dtype="fp32")).peak
        print(
            f"| {model} | {seq // 1024}k | {gpus} | {'on' if ac else 'off'} | {usual / GIB:.2f} | {same / GIB:.2f} "
            f"| {stack / GIB:.2f} | {stack / usual:.3f} | {stack / same:.3f} |"
        )


if __name__ == "__main__":
    main()
