"""The generation layer: the sampler's top-p / top-k against transformers' warpers, per-sample seeds in
evaluation, the FP8 serving linear in `infir2 eval --precision fp8`, and the engine registry -- a test
engine defined here with its own settings, registered by name, that `infir2 eval --engine` and
`rollout.engine` pick up."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import make_tiny_model
from infir2.cli import main
from infir2.eval import GRADERS, Graded, evaluate, problems_from_dicts
from infir2.export import export_model
from infir2.generation import (
    ENGINES,
    EngineOptions,
    Request,
    Sample,
    build_engine,
    knob,
    register_engine,
    stops_and_pad,
)
from infir2.generation.sampler import filter_probs
from infir2.rl import parse_rl_config
from train_synthetic import one_thread

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

_one_thread = pytest.fixture(autouse=True)(one_thread)


@dataclass(frozen=True, kw_only=True)
class LoopSettings:
    """The test engine's own settings (what a new engine declares beside its factory)."""

    copy_model: bool = knob(True, "generate from a copy that load_weights refreshes")


class LoopEngine:
    """A test engine: a full forward per token (no KV cache, no padding), one prompt at a time; the
    distribution and the seeding are those of ``base.Engine``'s contract. Counts its calls."""

    returns_ids, calls = True, 0

    def __init__(self, name: str, options: EngineOptions, settings: LoopSettings | None = None) -> None:
        assert options.model is not None
        model = options.model()
        self.name, self.label = name, "high (test loop)"
        self.model = copy.deepcopy(model).eval() if (settings or LoopSettings()).copy_model else model
        self.stops, _ = stops_and_pad(options.tokenizer)

    @torch.no_grad()
    def load_weights(self, policy) -> None:
        self.model.load_state_dict(policy.state_dict())

    @torch.no_grad()
    def generate(self, request: Request):
        LoopEngine.calls += 1
        sampling = request.sampling
        out = []
        for i, p in enumerate(request.prompts):
            out.append([])
            for j, seed in enumerate(p.seeds):
                gen, ids, logps = torch.Generator().manual_seed(seed), [], []
                while len(ids) < sampling.max_new_tokens and not (ids and ids[-1] in self.stops):
                    logits = self.model(torch.tensor([p.ids + ids])).logits[0, -1].float()
                    logp = torch.log_softmax(logits / sampling.temperature, -1)
                    tok = int(
                        logp.argmax() if sampling.greedy else torch.multinomial(logp.exp(), 1, generator=gen)
                    )
                    ids.append(tok)
                    logps.append(float(logp[tok]))
                out[i].append(Sample(ids, logps, finished=ids[-1] in self.stops))
                request.done(i, j, out[i][j])
        return out


@pytest.fixture
def loop_engine(monkeypatch):
    monkeypatch.setitem(ENGINES, "test-loop", ENGINES["builtin"])  # removed again after the test
    register_engine("test-loop", LoopEngine, settings=LoopSettings)  # what a new engine's module does
    LoopEngine.calls = 0
    return "test-loop"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    out = tmp_path_factory.mktemp("model") / "fp32"
    return export_model(make_tiny_model(hidden=128), tiny_tokenizer, out, fmt="fp32")


def _eval(model_dir: Path, out: Path, *extra: str) -> list[dict]:
    argv = ["eval", "--model", str(model_dir), "--max-new-tokens", "10", "--limit", "3", "--out", str(out)]
    assert main([*argv, *extra]) == 0
    return [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]


def test_top_p_and_top_k_keep_what_transformers_warpers_keep() -> None:
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen, dtype=torch.float64) * 3
    for top_p, top_k in [(0.9, 0), (0.5, 0), (1.0, 7), (0.8, 5), (1e-9, 0)]:
        ref = logits
        if top_k:
            ref = TopKLogitsWarper(top_k)(None, ref)
        if top_p < 1:
            ref = TopPLogitsWarper(top_p)(None, ref)
        mine = filter_probs(torch.softmax(logits, -1), top_p, top_k)
        assert torch.equal(mine > 0, torch.isfinite(ref)), (top_p, top_k)


def test_eval_samples_depend_on_their_seed_not_on_the_batch(tiny_tokenizer) -> None:
    problems = problems_from_dicts([{"problem": q, "answer": "1"} for q in ("a", "bb b", "c c c c")], "math")
    model = make_tiny_model()

    def texts(batch_size: int, seed: int) -> list[str]:
        kwargs = dict(n=3, max_new_tokens=8, temperature=1.0, top_p=0.9, batch_size=batch_size, seed=seed)
        result = evaluate(model, tiny_tokenizer, problems, progress=False, **kwargs)
        return [r["completion"] for r in result.records]

    together = texts(9, seed=1)
    assert together == texts(2, seed=1)
    assert together != texts(9, seed=2)
    assert len(set(together)) > 3


def test_eval_fp8_is_the_blockwise_recipe_forward(model_dir: Path, tmp_path: Path) -> None:
    served = _eval(model_dir, tmp_path / "s", "--precision", "fp8", "--greedy")  # the FP8 export's weights
    recipe = _eval(model_dir, tmp_path / "r", "--precision", "recipe", "--recipe", "blockwise", "--greedy")
    # pow2 128x128 weights + 1x128 activations: what the blockwise recipe computes in its forward
    assert [r["completion"] for r in served] == [r["completion"] for r in recipe]
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert summary["precision"] == "fp8 (the export's weights, pow2 scales)"
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["precision"] == "recipe (blockwise)"
    bad = ["--precision", "recipe", "--recipe", "nope", "--out", str(tmp_path / "x")]
    assert main(["eval", "--model", str(model_dir), *bad]) == 2


def test_perplexity_fp8_is_the_blockwise_recipe_loss(model_dir: Path, tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    (np.arange(200) * 7 % 300).astype("uint16").tofile(tok / "val.bin")
    (tok / "meta.json").write_text(json.dumps({"dtype": "uint16"}))

    def loss(*fp8: str) -> float:
        out = tmp_path / "-".join(["o", *fp8])
        flags = {"--model": model_dir, "--perplexity": tok, "--seq-len": 32, "--out": out}
        assert main(["eval", *(str(x) for kv in flags.items() for x in kv), *fp8]) == 0
        return json.loads((out / "loss.json").read_text())["loss"]

    high, served = loss(), loss("--precision", "fp8")
    recipe = loss("--precision", "recipe", "--recipe", "blockwise")
    assert served == pytest.approx(recipe, rel=1e-6) and abs(served - high) > 1e-6  # FP8, and the same FP8


def test_eval_picks_a_registered_engine_by_name(model_dir: Path, tmp_path: Path, loop_engine: str) -> None:
    builtin = _eval(model_dir, tmp_path / "builtin", "--greedy")
    loop = _eval(model_dir, tmp_path / "loop", "--greedy", "--engine", loop_engine)
    assert LoopEngine.calls == 1
    assert [r["completion"] for r in loop] == [r["completion"] for r in builtin]  # KV cache == full forwards
    assert json.loads((tmp_path / "loop" / "summary.json").read_text())["engine"] == loop_engine


def test_each_engine_is_built_from_its_own_settings(tiny_tokenizer, loop_engine: str) -> None:
    model = make_tiny_model()
    options = EngineOptions(tokenizer=tiny_tokenizer, model=lambda: model)
    assert build_engine(loop_engine, options, LoopSettings(copy_model=False)).model is model
    assert build_engine(loop_engine, options).model is not model  # its defaults: a copy
    with pytest.raises(
        TypeError, match=r"the builtin engine's settings are BuiltinSettings, got a LoopSettings"
    ):
        build_engine("builtin", options, LoopSettings())


def test_rl_picks_a_registered_engine_by_name(tmp_path: Path, tiny_tokenizer, monkeypatch, loop_engine: str):
    monkeypatch.setitem(GRADERS, "parity", lambda problem, text: Graded(None, len(text) % 2 == 1))
    policy = tmp_path / "policy"
    make_tiny_model(seed=1).save_pretrained(policy)
    tiny_tokenizer.save_pretrained(policy)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"problem": f"{i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(4))
    )
    cfg = {
        "run": {"name": "loop", "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "model": {"path": str(policy), "precision": "fp32"},
        "fp8": {"recipe": "bf16"},
        "data": {"prompts_path": str(prompts)},
        "rollout": {"engine": loop_engine, "precision": "high", "prompts_per_step": 2, "group_size": 3},
        "algo": {"reward": "parity", "dynamic_sampling": False, "micro_batch_size": 6},
        "train": {"max_steps": 2},
    }
    cfg["rollout"] |= {"oversample_prompts": 2, "max_new_tokens": 6, "batch_size": 6}
    (tmp_path / "rl.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["rl", str(tmp_path / "rl.yaml"), "--no-progress"]) == 0
    assert LoopEngine.calls == 2  # one generation round per step, through the registered engine
    lines = [json.loads(x) for x in (tmp_path / "runs" / "loop" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert all(
        m["mismatch/abs_dlogp_max"] < 1e-4 for m in lines
    )  # the trainer scores what the engine sampled


def test_rl_config_names() -> None:
    base = {"data": {"prompts_path": "p.jsonl"}}
    cfg = parse_rl_config({**base, "rollout": {"scale_encoding": "fp32"}})
    assert cfg.rollout.scale_encoding == "fp32" and cfg.data.task == "math"
    bad = [
        ({"rollout": {"engine": "vllm9"}}, r"rollout\.engine.*'vllm9', expected one of builtin"),
        ({"data": {"prompts_path": "p.jsonl", "task": "essay"}}, r"data\.task.*'essay'"),
        (
            {"data": {"prompts_path": "p.jsonl", "task": "multiple_choice"}},
            r"algo\.reward.*set algo.reward: multiple_choice",
        ),
    ]
    for extra, message in bad:
        with pytest.raises(ValueError, match=message):
            parse_rl_config({**base, **extra}, "x.yaml")
    mc = parse_rl_config({"data": {"task": "multiple_choice"}, "algo": {"reward": "multiple_choice"}})
    assert mc.data.task == mc.algo.reward == "multiple_choice"
