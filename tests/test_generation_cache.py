"""The KV cache of the one sampler, on every transformers version infir2 admits.

transformers renamed the forward keyword of the KV cache (``past_key_values`` -> ``cache``); an older
version's ``**kwargs`` swallows the new name, so a sampler that passes the wrong one decodes every token
from the newest token alone and nothing fails. These tests compare the cached sampler with two things
that do not use its cache: a full forward over the whole sequence per token, and transformers' own
``generate``. CI runs this file under the newest transformers and again under the oldest admitted one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

from conftest import make_tiny_model
from infir2.cli import main
from infir2.export import export_model
from infir2.generation import SamplingConfig, sample_batch
from infir2.generation import sampler as sampler_module
from infir2.generation.sampler import cache_keyword
from train_synthetic import one_thread

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

_one_thread = pytest.fixture(autouse=True)(one_thread)

PROMPTS = [[5, 17, 42, 9, 3], [88, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [250]]  # uneven: left padding
PAD, STOPS = 0, [299]  # token 299: a stop the random model may or may not draw


def _uncached(model, prompt: list[int], steps: int, temperature: float) -> tuple[list[int], list[float]]:
    """Greedy decoding by a full forward over the whole sequence for every token: no cache, no padding."""
    ids, logps = list(prompt), []
    for _ in range(steps):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        logp = torch.log_softmax(logits / temperature, -1)
        tok = int(logp.argmax())
        ids.append(tok)
        logps.append(float(logp[tok]))
        if tok in STOPS:
            break
    return ids[len(prompt) :], logps


def _greedy(max_new_tokens: int, temperature: float = 1.0) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, greedy=True)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_cached_greedy_equals_full_recompute(arch: str, temperature: float) -> None:
    model = make_tiny_model(arch, seed=3).eval()
    gens = [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]
    samples = sample_batch(model, PROMPTS, gens, _greedy(12, temperature), STOPS, PAD, None)
    with torch.no_grad():
        for prompt, sample in zip(PROMPTS, samples, strict=True):
            ref_ids, ref_logps = _uncached(model, prompt, 12, temperature)
            assert sample.response_ids == ref_ids, prompt
            # fp32 logits through another reduction order (cache + padding vs one full pass)
            torch.testing.assert_close(
                torch.tensor(sample.logprobs, dtype=torch.float64),
                torch.tensor(ref_logps, dtype=torch.float64),
                rtol=0,
                atol=2e-5,
            )


def test_greedy_equals_transformers_generate() -> None:
    model = make_tiny_model("qwen2", seed=5).eval()
    gens = [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]
    samples = sample_batch(model, PROMPTS, gens, _greedy(10), STOPS, PAD, None)
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=STOPS,
        pad_token_id=PAD,
    )[:, width:]
    for sample, row in zip(samples, out.tolist(), strict=True):
        stop = next((j for j, t in enumerate(row) if t in STOPS), len(row) - 1)
        assert sample.response_ids == row[: stop + 1]


def test_cache_keyword_is_a_forward_parameter_of_this_transformers() -> None:
    import inspect

    model = make_tiny_model("qwen2")
    name = cache_keyword(model)
    assert name in inspect.signature(type(model).forward).parameters
    # the name the installed version reads (newer: `cache`; 5.17 to 5.2x: `past_key_values`)
    layer_params = inspect.signature(type(model.model.layers[0].self_attn).forward).parameters
    assert name in layer_params


def test_cache_keyword_sees_through_peft() -> None:
    peft = pytest.importorskip("peft")
    model = make_tiny_model("qwen2")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert cache_keyword(lora) == cache_keyword(model)


def test_a_cache_the_model_ignores_raises(monkeypatch) -> None:
    """A future rename: the cache handed over under a name the model's ``**kwargs`` swallow."""
    model = make_tiny_model("qwen2").eval()
    monkeypatch.setattr(sampler_module, "cache_keyword", lambda model: "kv_cache_of_the_future")
    with pytest.raises(RuntimeError, match="did not use the cache passed as `kv_cache_of_the_future=`"):
        sample_batch(model, PROMPTS, [torch.Generator()] * len(PROMPTS), _greedy(4), STOPS, PAD, None)


def test_a_forward_without_a_cache_parameter_is_refused() -> None:
    class NoCache(torch.nn.Module):
        def forward(self, input_ids, **kwargs):
            return input_ids

    with pytest.raises(TypeError, match="neither `cache` nor `past_key_values`"):
        cache_keyword(NoCache())


CROSS_VERSION_DIR = "INFIR2_CROSS_VERSION_DIR"


def test_eval_greedy_completions_are_the_same_on_every_transformers(tmp_path: Path, tiny_tokenizer) -> None:
    """``infir2 eval`` greedy on a fixed small model. With ``INFIR2_CROSS_VERSION_DIR`` set (CI does,
    for its run under the newest and under the oldest admitted transformers), each run writes its
    completions there under its transformers version and compares them with every other version's."""
    folder = os.environ.get(CROSS_VERSION_DIR)
    if not folder:
        pytest.skip(f"set {CROSS_VERSION_DIR} to compare completions across transformers versions")
    model_dir = export_model(make_tiny_model(hidden=128, seed=11), tiny_tokenizer, tmp_path / "m", fmt="fp32")
    argv = ["eval", "--model", str(model_dir), "--greedy", "--max-new-tokens", "32"]  # the 8 shipped problems
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    records = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    completions = [r["completion"] for r in records]
    assert len(completions) == 8
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"eval-greedy-{transformers.__version__}.json").write_text(json.dumps(completions))
    others = sorted(
        p for p in out.glob("eval-greedy-*.json") if p.stem != f"eval-greedy-{transformers.__version__}"
    )
    for other in others:
        theirs = json.loads(other.read_text())
        differ = [i for i, (a, b) in enumerate(zip(completions, theirs, strict=True)) if a != b]
        assert not differ, (
            f"{len(differ)} of 8 greedy completions differ from {other.name}: first #{differ[0]}"
        )
