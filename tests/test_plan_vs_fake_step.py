"""The planner (``planning.plan``, ``device="cpu"``) against the real training step run on fake tensors
with torch's memory tracker (``tools.fake_step``): each term within 10%, for the bf16 baseline and FP8
blockwise, fp32 and fp8 moments, fp32 and bf16 gradients, activation checkpointing on and off, and
two accumulated micro-batches. So a term the step changes cannot go stale unseen.

The shape: two decoder layers of Qwen2.5-1.5B's width (1536 / 8960, 12 heads, 2 KV heads), an untied
32,000-word vocabulary (the head's terms do not swamp the layers'), 4,096 tokens (the loss chunked, as at 8k). Full 1.5B / 7B
shapes: ``benchmarks/plan_vs_fake_step.py`` (BENCHMARKS.md). Where the plan and the step disagree
beyond the tolerance the case is an expected failure whose reason gives the measured numbers
(``GAPS``); it fails (strict) when the gap closes, so that the table is kept true.
"""

from __future__ import annotations

import functools

import pytest

from infir2.planning import ModelShape
from infir2.tools.fake_step import TERMS, FakeStep, StepSettings, compare, fake_step, model_fields

TOLERANCE = 0.10
TOKENS = 4096
CASES: dict[str, dict[str, object]] = {
    "fp8": {},
    "bf16": {"recipe": "bf16"},
    "fp8-no-ckpt": {"activation_checkpointing": False},
    "bf16-no-ckpt": {"recipe": "bf16", "activation_checkpointing": False},
    "fp8-moments": {"state_dtype": "fp8"},
    "bf16-grads": {"grad_dtype": "bf16"},
    "two-micro-batches": {"micro_batches": 2},
}
#: (case, term) -> why the plan and the step differ, with the measured MiB (plan / tracked)
SUM = (
    "the plan's backward peak adds every parameter's gradient to every activation, but with one "
    "micro-batch per step no gradient exists when backward starts (zero_grad(set_to_none)): plan over"
)
TEMPORARIES = (
    "without checkpointing the activations' peak is at the start of backward, where the plan counts "
    "the saved tensors and two [chunk, V] logit blocks but not the head's [V, H] fp32 gradient before it "
    "lands nor the first layers' activation gradients: plan under"
)
GAPS: dict[tuple[str, str], str] = {
    ("fp8", "backward_peak"): f"plan 4073 / tracked 3685 MiB (1.105): {SUM}",
    ("fp8", "peak"): f"plan 4073 / tracked 3685 MiB (1.105): {SUM}",
    ("bf16", "backward_peak"): f"plan 4160 / tracked 3683 MiB (1.130): {SUM}",
    ("bf16", "peak"): f"plan 4160 / tracked 3683 MiB (1.130): {SUM}",
    ("fp8-moments", "backward_peak"): f"plan 2987 / tracked 2598 MiB (1.149): {SUM}",
    ("fp8-moments", "peak"): f"plan 2987 / tracked 2598 MiB (1.149): {SUM}",
    ("bf16", "activations"): (
        "plan 1232 / tracked 1092 MiB (1.128): with checkpointing the plan adds the recomputed layer's "
        "full set (fp32 bf16-baseline layer, 'infir2 memory --device cpu') to the logits' backward "
        "blocks, which the step never holds at once: plan over"
    ),
    ("fp8-no-ckpt", "activations"): f"plan 1630 / tracked 2094 MiB (0.778): {TEMPORARIES}",
    ("bf16-no-ckpt", "activations"): f"plan 1804 / tracked 2272 MiB (0.794): {TEMPORARIES}",
}


def _fields() -> dict[str, object]:
    fields = model_fields("qwen2.5-1.5b", layers=2)
    return {**fields, "vocab_size": 32000, "tie_word_embeddings": False}


@functools.cache
def _measured(case: str) -> FakeStep:
    return fake_step(_fields(), StepSettings(seq_len=TOKENS, **CASES[case]))  # type: ignore[arg-type]


def _params() -> list[object]:
    out = []
    for case in CASES:
        for term in TERMS:
            gap = GAPS.get((case, term))
            marks = [pytest.mark.xfail(reason=gap, strict=True)] if gap else []
            out.append(pytest.param(case, term, marks=marks, id=f"{case}-{term}"))
    return out


@pytest.mark.parametrize(("case", "term"), _params())
def test_the_plan_matches_the_fake_step(case: str, term: str) -> None:
    settings = StepSettings(seq_len=TOKENS, **CASES[case])  # type: ignore[arg-type]
    shape = ModelShape.from_config(_fields(), "1.5B width, 2 layers")
    planned, tracked = compare(_measured(case), settings.plan(shape))[term]
    assert tracked > 0, f"{case}: nothing tracked for {term}"
    mib = f"plan {planned / 2**20:.0f} MiB, tracked {tracked / 2**20:.0f} MiB"
    assert abs(planned / tracked - 1) <= TOLERANCE, f"{case} {term}: {mib} ({planned / tracked:.3f})"


def test_the_options_change_the_tracked_terms_as_planned() -> None:
    """The step itself sees each option: fp8 moments are about a quarter of fp32's bytes, bf16
    gradients about half, checkpointing lowers the activations' peak (not a plan figure: the step's)."""
    base = _measured("fp8")
    assert 0.2 < _measured("fp8-moments").optimizer / base.optimizer < 0.3
    assert 0.45 < _measured("bf16-grads").gradients / base.gradients < 0.7
    assert _measured("fp8-no-ckpt").activations > base.activations
