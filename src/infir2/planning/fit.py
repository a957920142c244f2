"""Whether a plan fits its GPU, said plainly; and what would fit when it does not."""

from __future__ import annotations

from dataclasses import replace

from ..fp8.formats import BLOCK
from .dense import plan_step
from .inputs import PlanInputs
from .rl import RLPlan, peak_phase
from .shape import ModelShape

__all__ = ["GPU_GIB", "USABLE", "fewest_gpus", "fit_advice", "rl_fit", "what_fits"]

#: memory of one GPU (GiB) by name: what a plan must fit (``--gpu``)
GPU_GIB: dict[str, float] = {"h100": 80.0, "h200": 141.0, "a100": 80.0, "b200": 180.0, "l40s": 48.0}
#: the share of a GPU a plan may fill: the CUDA context, the allocator's fragmentation and NCCL buffers
#: take the rest
USABLE = 0.9


def fit_advice(shape: ModelShape, run: PlanInputs, peak: float, gpu: str) -> str:
    """Whether the FP8 plan's peak fits ``USABLE`` of ``gpu``, and if not, what would (each planned)."""
    gib, limit = 2**30, GPU_GIB[gpu] * USABLE * 2**30
    if peak <= limit:
        return f"fits a {gpu.upper()} ({GPU_GIB[gpu]:.0f} GiB): peak {peak / gib:.1f} GiB per GPU"
    options = []
    if not run.activation_checkpointing:
        with_ac = plan_step(shape, replace(run, activation_checkpointing=True)).peak
        options.append(f"activation checkpointing ({with_ac / gib:.1f} GiB)")
    for gpus in (run.gpus * 2, run.gpus * 4, run.gpus * 8):
        more = plan_step(shape, replace(run, gpus=gpus)).peak
        if more <= limit:
            options.append(f"{gpus} GPUs ({more / gib:.1f} GiB)")
            break
    for context in (2, 4, 8):
        if run.context < context and run.gpus % context == 0 and run.seq_len % (context * BLOCK) == 0:
            sharded = plan_step(shape, replace(run, context=context)).peak
            if sharded <= limit:
                options.append(f"--context {context} ({sharded / gib:.1f} GiB)")
                break
    seq = run.seq_len // 2
    while seq >= 1024:
        shorter = plan_step(shape, replace(run, seq_len=seq)).peak
        if shorter <= limit:
            options.append(f"--seq-len {seq} ({shorter / gib:.1f} GiB)")
            break
        seq //= 2
    what = "; ".join(options) or "nothing tried here fits (a larger GPU, or context parallelism)"
    return (
        f"warning: does not fit a {gpu.upper()} ({GPU_GIB[gpu]:.0f} GiB, {USABLE:.0%} usable): FP8 peak "
        f"{peak / gib:.1f} GiB per GPU. What would fit, each alone: {what}"
    )


def fewest_gpus(shape: ModelShape, run: PlanInputs, gpu: str, most: int = 64) -> int | None:
    """The fewest GPUs (1, 2, 4, ... ``most``) on which ``run`` fits ``USABLE`` of ``gpu``; None: none.
    bf16 gradients exist on one GPU only: beyond it the run keeps fp32 ones."""
    limit, gpus = GPU_GIB[gpu] * USABLE * 2**30, 1
    while gpus <= most:
        if gpus % run.context == 0:  # the GPUs are data x context
            trial = replace(run, gpus=gpus, grad_dtype=run.grad_dtype if gpus == 1 else "fp32")
            if plan_step(shape, trial).peak <= limit:
                return gpus
        gpus *= 2
    return None


def what_fits(shape: ModelShape, run: PlanInputs, gpu: str) -> str:
    """One line: the fewest GPUs for BF16 as most runs train (fp32 moments and gradients), BF16 with
    ``run``'s optimizer options, and ``run``'s recipe with them."""
    usual = replace(run, recipe="bf16", state_dtype="fp32", grad_dtype="fp32", state_expand=False)
    rows = [("BF16, fp32 moments and gradients", usual), ("BF16, these options", replace(run, recipe="bf16"))]
    rows.append((f"{run.recipe}, these options", run))
    said = []
    for label, r in rows:
        n = fewest_gpus(shape, r, gpu)
        said.append(
            f"{label}: {'none of 1 to 64 GPUs' if n is None else f'{n} GPU' + ('s' if n > 1 else '')}"
        )
    return (
        f"what fits a {gpu.upper()} ({USABLE:.0%} of {GPU_GIB[gpu]:.0f} GiB) at {run.seq_len} tokens: "
        + "; ".join(said)
    )


def rl_fit(p: RLPlan, gpu: str) -> str:
    """Whether the RL step's peak fits ``USABLE`` of ``gpu``: said plainly, with the phase that peaks."""
    gib, limit = 2**30, GPU_GIB[gpu] * USABLE * 2**30
    phase = peak_phase(p)
    if p.peak <= limit:
        return (
            f"fits a {gpu.upper()} ({GPU_GIB[gpu]:.0f} GiB): peak {p.peak / gib:.1f} GiB per GPU, in {phase}"
        )
    return (
        f"does not fit a {gpu.upper()} ({GPU_GIB[gpu]:.0f} GiB, {USABLE:.0%} usable): peak {p.peak / gib:.1f} "
        f"GiB per GPU, in {phase} (more GPUs shard the policy and its optimizer, not the reference or the "
        "engine, which every rank holds whole)"
    )
