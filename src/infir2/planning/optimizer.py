"""The optimizer's terms: AdamW's moments per GPU and the temporaries of its step (``optim.state_dtype``).

* ``fp32``  torch's AdamW: two fp32 moments, 8 bytes per parameter;
* ``bf16``  ``LowPrecisionAdamW``: two bf16 moments, 4 bytes per parameter;
* ``fp8``   ``Fp8AdamW``: per parameter of two or more dimensions two 1-byte codes and, per ``block``
            elements of a row, one fp32 scale per moment (``2 + 8 / block`` bytes: 2.0625 at 128; the
            rows of every shipped shape are whole blocks); 1-D parameters (norms, biases) keep fp32
            moments (8 bytes).

Gradients (``optim.grad_dtype``): fp32, 4 bytes per parameter; bf16 (``harness.grads``: one process),
2 bytes per parameter and, while autograd hands one over, the largest parameter's fp32 gradient in
place of its bf16 copy (made right after). One process accumulating micro-batches (a stored gradient
to add to): the arriving fp32 gradient beside every stored one, and with bf16 ``harness.grads``' fp32
copy of the stored one too (2 x 4 bytes of the largest). Measured against the real step under
``FakeTensorMode`` by ``tools.fake_step`` (``tests/test_plan_vs_fake_step.py``).

The step's temporaries, when the activations are gone: torch's foreach AdamW on a CPU makes an fp32
tensor per parameter at once (``sqrt(v)``: 4 bytes per parameter), the fused one on CUDA none;
``LowPrecisionAdamW`` and ``Fp8AdamW`` update one slice of at most ``fp8.moments.STEP_ELEMENTS`` elements at
a time, so their temporaries are ``STEP_COPIES`` fp32 copies of one slice (of the largest parameter when
it is smaller), as measured by ``benchmarks/optimizer_step_memory.py``.
"""

from __future__ import annotations

from ..fp8.moments import STEP_ELEMENTS
from .inputs import BF16_BYTES, FP32_BYTES, PlanInputs
from .shape import ModelShape

__all__ = [
    "GRAD_DTYPES",
    "STATE_DTYPES",
    "STEP_COPIES",
    "arriving_gradient_bytes",
    "gradient_bytes",
    "moment_bytes",
    "optimizer_step_bytes",
]

STATE_DTYPES = ("fp32", "bf16", "fp8")
GRAD_DTYPES = ("fp32", "bf16")
#: fp32 copies of one slice alive at once in a slice-by-slice step, rounded up from
#: ``benchmarks/optimizer_step_memory.py`` (151,936 x 896, 2026-12-07, two runs: 320 / 450-496 / 640-704
#: / 544-550 MiB of 64 MiB slices for bf16, fp8, fp8 with range expansion, fp8 with bf16 gradients): the moments read
#: back, the denominator, the quantizer's; COAT's expansion adds its powers, a bf16 gradient its fp32 copy
STEP_COPIES = {"bf16": 5, "fp8": 8}
EXPANSION_COPIES, BF16_GRAD_COPIES = 3, 1


def moment_bytes(shape: ModelShape, run: PlanInputs) -> float:
    """Both moments of the whole model (not yet divided over the GPUs)."""
    if run.state_dtype == "fp32":
        return 2 * FP32_BYTES * shape.params
    if run.state_dtype == "bf16":
        return 2 * BF16_BYTES * shape.params
    vectors = shape.vector_params
    matrices = shape.params - vectors
    return matrices * (2 + 2 * FP32_BYTES / run.state_block) + 2 * FP32_BYTES * vectors


def optimizer_step_bytes(shape: ModelShape, run: PlanInputs) -> float:
    """The step's temporaries on one GPU (module doc); not yet divided over the GPUs."""
    if run.state_dtype == "fp32" and run.grad_dtype == "fp32":
        return FP32_BYTES * shape.params if run.cpu else 0.0
    copies = STEP_COPIES.get(run.state_dtype, STEP_COPIES["bf16"])  # fp32 moments with bf16 gradients: bf16's
    copies += (EXPANSION_COPIES if run.state_expand else 0) + (
        BF16_GRAD_COPIES if run.grad_dtype == "bf16" else 0
    )
    return copies * FP32_BYTES * min(shape.largest_param, STEP_ELEMENTS)


def gradient_bytes(shape: ModelShape, run: PlanInputs) -> float:
    """The gradients of the whole model at the peak of backward (not yet divided over the GPUs): the
    stored ones and ``arriving_gradient_bytes`` (module doc)."""
    stored = (FP32_BYTES if run.grad_dtype == "fp32" else BF16_BYTES) * shape.params
    if run.grad_dtype == "bf16" and not _accumulating(run):  # the largest's bf16 copy comes after
        stored -= BF16_BYTES * shape.largest_param
    return stored + arriving_gradient_bytes(shape, run)


def arriving_gradient_bytes(shape: ModelShape, run: PlanInputs) -> float:
    """The part of ``gradient_bytes`` that lives only while autograd hands the largest parameter's fp32
    gradient over (none after backward: not in the optimizer step's peak)."""
    arriving = FP32_BYTES * shape.largest_param
    if run.grad_dtype == "fp32":
        return arriving if _accumulating(run) else 0.0  # else it is the stored gradient itself
    return 2 * arriving if _accumulating(run) else arriving  # accumulating: ``harness.grads``' fp32 copy


def _accumulating(run: PlanInputs) -> bool:
    """One process adding micro-batches' gradients: a stored gradient is there when the next arrives."""
    return run.gpus == 1 and run.micro_steps > 1
