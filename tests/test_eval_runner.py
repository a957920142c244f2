"""evaluate(): batched left-padded KV-cache generation vs a plain argmax loop, scoring vs hand counts, FP8 switch."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from infir2 import convert_to_fp8
from infir2.data.chat import render_prompt
from infir2.eval.metrics import pass_at_k
from infir2.eval.runner import evaluate, run_evaluation
from infir2.generation import Sample, SamplingConfig
from infir2.tasks import problems_from_dicts

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

QUESTIONS = ["What is 7 * 6?", "1+1?", "What is the sum of twelve and thirty, in words and digits?"]


def _argmax_loop(model, tokenizer, prompt: str, steps: int) -> list[int]:
    """Reference: one sequence, no padding, no KV cache, full forward pass per token."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    stops = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    new: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            new.append(nxt)
            if nxt in stops:
                break
    return new


def test_render_prompt_follows_the_protocol(tiny_tokenizer) -> None:
    text = render_prompt(tiny_tokenizer, "Q?")
    assert text == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_batched_greedy_matches_unbatched_argmax_loop(tiny_tokenizer) -> None:
    model = make_tiny_model().eval()
    problems = problems_from_dicts([{"problem": q, "answer": "1"} for q in QUESTIONS], "math")
    steps = 12
    got = evaluate(model, tiny_tokenizer, problems, greedy=True, max_new_tokens=steps, batch_size=3).records
    for q, completion in zip(QUESTIONS, got, strict=True):
        ref = _argmax_loop(model, tiny_tokenizer, render_prompt(tiny_tokenizer, q), steps)
        stopped = ref[-1] in {tiny_tokenizer.convert_tokens_to_ids("<|im_end|>"), tiny_tokenizer.eos_token_id}
        text = tiny_tokenizer.decode(ref[:-1] if stopped else ref, skip_special_tokens=True)
        assert (completion["completion"], completion["n_tokens"], completion["finished"]) == (
            text,
            len(ref),
            stopped,
        )


class ScriptedEngine:
    """Returns the scripted texts in the order asked (problem-major, then sample)."""

    name, label, returns_ids = "scripted", "none", False

    def __init__(self, texts: list[str], finished: list[bool]) -> None:
        self.texts, self.finished = texts, finished

    def generate(self, request):
        prompts = request.prompts
        assert (
            len(prompts) == 2
            and all(len(p.seeds) == 3 for p in prompts)
            and prompts[0].text != prompts[1].text
        )
        assert len({s for p in prompts for s in p.seeds}) == 6  # a seed per sample
        out = []
        for i, p in enumerate(prompts):
            out.append([])
            for j in range(len(p.seeds)):
                k = 3 * i + j
                out[i].append(Sample([], [], self.finished[k], text=self.texts[k], n_tokens=5))
                request.on_sample(i, j, out[i][j])
        return out


def test_scores_match_hand_counts(tiny_tokenizer) -> None:
    problems = problems_from_dicts(
        [{"problem": "a", "answer": "42"}, {"problem": "b", "answer": r"\frac{1}{2}"}], "math"
    )
    # per job (problem-major, 3 samples each): problem a -> 2 right + 1 unboxed; b -> 1 right (0.5), 1 wrong, 1 cut off
    scripted = [
        r"\boxed{42}",
        "</think> it is 42",
        r"<think>\boxed{7}</think>\boxed{42}",
        r"\boxed{0.5}",
        r"\boxed{2}",
        "<think> still going",
    ]
    finished = [True, True, True, True, True, False]

    engine = ScriptedEngine(scripted, finished)
    result = run_evaluation(engine, tiny_tokenizer, problems, "math", 3, SamplingConfig(), progress=False)
    s = result.summary
    assert s["avg@n"] == pytest.approx(3 / 6)
    assert s["pass@1"] == pytest.approx(3 / 6)
    assert s["pass@2"] == pytest.approx((pass_at_k(3, 2, 2) + pass_at_k(3, 1, 2)) / 2)
    assert s["pass@3"] == pytest.approx(1.0)
    assert (s["unparseable"], s["truncated"], s["samples"]) == (2, 1, 6)
    assert [p["n_correct"] for p in result.problems] == [2, 1]
    assert [r["extracted"] for r in result.records] == ["42", None, "42", "0.5", "2", None]
    assert "| avg@n | 0.5000 |" in result.markdown()


def test_fp8_is_off_by_default(tiny_tokenizer) -> None:
    problems = problems_from_dicts([{"problem": q, "answer": "42"} for q in QUESTIONS], "math")
    kwargs = dict(greedy=True, max_new_tokens=8, batch_size=2)
    reference = evaluate(make_tiny_model(), tiny_tokenizer, problems, **kwargs)
    converted = convert_to_fp8(make_tiny_model())
    high = evaluate(converted, tiny_tokenizer, problems, **kwargs)
    assert [r["completion"] for r in high.records] == [r["completion"] for r in reference.records]
    assert all(
        m.fp8_enabled for name, m in converted.named_modules() if hasattr(m, "fp8_enabled")
    )  # restored
    fp8 = evaluate(converted, tiny_tokenizer, problems, precision="recipe", **kwargs)
    assert fp8.summary["precision"] == "recipe (blockwise)" and len(fp8.records) == len(problems)
    assert reference.summary["dtype"] == "float32"  # what the high-precision parts computed in
    with pytest.raises(ValueError, match="no Fp8Linear"):
        evaluate(make_tiny_model(), tiny_tokenizer, problems, precision="recipe", **kwargs)


def test_bad_arguments(tiny_tokenizer) -> None:
    problems = problems_from_dicts([{"problem": "q", "answer": "1"}], "math")
    model = make_tiny_model()
    with pytest.raises(ValueError, match="greedy"):
        evaluate(model, tiny_tokenizer, problems, n=2, greedy=True)
    with pytest.raises(ValueError, match="not of task 'multiple_choice'"):
        evaluate(model, tiny_tokenizer, problems, task="multiple_choice")
    with pytest.raises(ValueError, match="temperature"):
        evaluate(model, tiny_tokenizer, problems, temperature=0.0)


def test_plain_dicts_are_accepted(tiny_tokenizer) -> None:
    result = evaluate(
        make_tiny_model(),
        tiny_tokenizer,
        [{"problem": "7 * 6 = ?", "answer": "42"}],
        greedy=True,
        max_new_tokens=2,
    )
    assert result.summary["problems"] == 1 and result.records[0]["id"] == "0"
    with pytest.raises(ValueError, match="item 0: missing key"):
        evaluate(make_tiny_model(), tiny_tokenizer, [{"question": "q"}], max_new_tokens=2)
