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
#: (case, term) -> why the plan and the step differ, with the measured MiB (plan / tracked), at commit
#: 6045899 (the scorer's one-block backward merged): the backward and step peaks are within 10% there
#: (before it the plan's backward peak was 1.10-1.15x over); the activations' peak is not. The MiB
#: below are those measured once the RMSNorm recompute (model.recompute_norm) was on in both (the same
#: gaps: both sides lost the norms' outputs)
ONE_BLOCK = (
    "the plan adds the scorer's [chunk, V] logit block to the recomputed layer's saved set, but the two "
    "are never alive together (the scorer's backward ends before the last layer is recomputed), and it "
    "counts none of the layer backward's temporaries (its [T, I] activation gradients), where the tracked "
    "peak is: the gap does not move with the vocabulary (251 MiB at 32,000 and 64,000 words), vanishes at "
    "half the MLP width (-3 MiB at I = 4480) and turns over at half the tokens (the plan 277 MiB above at "
    "2,048); plan under"
)
TEMPORARIES = (
    "without checkpointing the activations' peak is at the start of backward, where the plan counts the "
    "saved tensors and the logit block but not the head's [V, H] fp32 gradient before it lands nor the "
    "first layers' activation gradients: plan under"
)
GAPS: dict[tuple[str, str], str] = {
    ("fp8", "activations"): f"plan 841 / tracked 1092 MiB (0.770): {ONE_BLOCK}",
    ("bf16", "activations"): f"plan 928 / tracked 1044 MiB (0.889): {ONE_BLOCK}",
    ("fp8-moments", "activations"): f"plan 841 / tracked 1092 MiB (0.770): {ONE_BLOCK}",
    ("bf16-grads", "activations"): f"plan 841 / tracked 1092 MiB (0.770): {ONE_BLOCK}",
    ("two-micro-batches", "activations"): f"plan 841 / tracked 1092 MiB (0.770): {ONE_BLOCK}",
    ("fp8-no-ckpt", "activations"): f"plan 1278 / tracked 1528 MiB (0.837): {TEMPORARIES}",
    ("bf16-no-ckpt", "activations"): f"plan 1452 / tracked 1676 MiB (0.866): {TEMPORARIES}",
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
