"""The planner's table of issue 56: FP8 never above BF16 at the same options, the 7B single-GPU goal, and
the "what fits" line (``planning.fit``)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from infir2.planning import PlanInputs, fewest_gpus, load_shape, plan_step, what_fits

GIB = 2**30
TABLE = [
    row
    for row in itertools.product(
        ("qwen2.5-1.5b", "qwen2.5-7b"),
        (8192, 32768),
        (1, 8),
        (False, True),
        ("fp32", "bf16", "fp8"),
        ("fp32", "bf16"),
    )
    if row[-1] == "fp32" or row[2] == 1  # bf16 gradients: one GPU only
]


@pytest.mark.parametrize(("model", "seq", "gpus", "ac", "state", "grads"), TABLE)
def test_fp8_is_never_above_bf16_with_the_same_options(model, seq, gpus, ac, state, grads) -> None:
    _, shape = load_shape(model)
    run = PlanInputs(
        "blockwise", gpus=gpus, seq_len=seq, activation_checkpointing=ac, state_dtype=state, grad_dtype=grads
    )
    assert plan_step(shape, run).peak <= plan_step(shape, replace(run, recipe="bf16")).peak


def test_7b_full_parameter_sft_at_8k_fits_one_80gb_gpu_with_the_fp8_stack() -> None:
    """The issue's goal: planned peak <= 72 GiB and <= 0.60x BF16 with fp32 moments and gradients (~120 GiB)."""
    _, shape = load_shape("qwen2.5-7b")
    stack = PlanInputs(
        "blockwise", gpus=1, seq_len=8192, activation_checkpointing=True, state_dtype="fp8", grad_dtype="bf16"
    )
    usual = replace(stack, recipe="bf16", state_dtype="fp32", grad_dtype="fp32")
    fp8, bf16 = plan_step(shape, stack).peak, plan_step(shape, usual).peak
    assert fp8 <= 72 * GIB and 115 * GIB < bf16 < 125 * GIB
    assert fp8 / bf16 <= 0.60
    assert fewest_gpus(shape, stack, "h100") == 1 and fewest_gpus(shape, usual, "h100") == 2
    line = what_fits(shape, stack, "h100")
    assert "BF16, fp32 moments and gradients: 2 GPUs" in line and "blockwise, these options: 1 GPU" in line
