"""The built-in engine as RL's rollout engine: FP8 weights bit-identical to `infir2 export --format fp8`,
log-probabilities equal to the trainer's when both quantize identically, greedy decoding equal to
transformers' generate."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_tiny_model
from infir2.cli import main
from infir2.data.chat import stop_token_ids
from infir2.export import export_model
from infir2.generation import BuiltinEngine, RolloutEngine, SamplingConfig, derive_seeds
from infir2.model import prepare_for_training
from infir2.rl.algorithm import mismatch_metrics
from infir2.rl.batch import RLBatch
from infir2.rl.update import response_logprobs
from train_synthetic import one_thread

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers
_one_thread = pytest.fixture(autouse=True)(one_thread)


PROMPTS = ["Compute 7 + 5 - 3.", "The quick brown fox", "12 + 30 = "]


def _engine(policy, tok, precision, scale="pow2", max_new_tokens=12, batch_size=4):
    """RL's engine as `rollout.precision: PRECISION` builds it (fp8: the export's FP8 linear)."""
    builtin = BuiltinEngine(
        policy, tok, precision=precision, scale_encoding=scale, model_precision="fp32", copy_model=True
    )
    return RolloutEngine(
        builtin,
        SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, batch_size=batch_size),
    )


def _exported_fp8(policy, tok, tmp_path, name, pow2=True) -> dict[str, torch.Tensor]:
    """What `infir2 export --format fp8` writes for the policy's current (fp32) weights."""
    src = export_model(policy, tok, tmp_path / f"{name}-fp32", fmt="fp32")
    out = tmp_path / f"{name}-fp8"
    assert (
        main(
            [
                "export",
                "--model",
                str(src),
                "--out",
                str(out),
                "--format",
                "fp8",
                *([] if pow2 else ["--scale-encoding", "fp32"]),
            ]
        )
        == 0
    )
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors |= load_file(f)
    return tensors


def _assert_bit_identical(engine: RolloutEngine, exported: dict[str, torch.Tensor]) -> None:
    assert isinstance(engine.engine, BuiltinEngine)
    mine = engine.engine.quantized_weights()
    assert len(mine) == 2 * 7 * 2  # 7 projections x 2 layers, codes + scale_inv
    for name, t in mine.items():
        ref = exported[name]
        assert ref.dtype == t.dtype and ref.shape == t.shape, name
        assert torch.equal(
            ref.view(torch.uint8) if ref.dtype == torch.float8_e4m3fn else ref.view(torch.int32),
            t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32),
        ), name


def test_fp8_rollout_weights_are_the_fp8_export_bit_for_bit(tmp_path, tiny_tokenizer):
    policy = prepare_for_training(make_tiny_model(), "blockwise")
    engine = _engine(policy, tiny_tokenizer, "fp8")
    _assert_bit_identical(engine, _exported_fp8(policy, tiny_tokenizer, tmp_path, "step0"))
    with torch.no_grad():  # an update, then the engine takes the new weights
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    engine.load_weights(policy)
    _assert_bit_identical(engine, _exported_fp8(policy, tiny_tokenizer, tmp_path, "step1"))
    fp32_engine = _engine(policy, tiny_tokenizer, "fp8", scale="fp32")
    _assert_bit_identical(fp32_engine, _exported_fp8(policy, tiny_tokenizer, tmp_path, "fp32s", pow2=False))


def _mismatch(recipe: str, rollout: str, tok) -> dict[str, float]:
    policy = prepare_for_training(make_tiny_model(), recipe)
    engine = _engine(policy, tok, rollout)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    groups = engine.generate(prompts, 3, seed=1)
    flat = [(prompts[i], r) for i, g in enumerate(groups) for r in g]
    with torch.no_grad():
        batch = RLBatch.of_responses(
            [p for p, _ in flat], [r.response_ids for _, r in flat], tok.pad_token_id
        )
        rows = batch.rows(list(range(len(batch))))
        logp, _ = response_logprobs(policy, rows, 1.0, "fp32")
        mask = rows.response_mask
    roll = torch.zeros_like(logp)
    for i, (_, r) in enumerate(flat):
        roll[i, : len(r.logprobs)] = torch.tensor(r.logprobs)
    return mismatch_metrics(logp, roll, mask, 2.0)


@pytest.mark.parametrize("recipe, rollout", [("blockwise", "fp8"), ("bf16", "high")])
def test_identical_quantization_has_no_mismatch(tiny_tokenizer, recipe, rollout):
    m = _mismatch(recipe, rollout, tiny_tokenizer)
    assert m["mismatch/abs_dlogp_max"] < 1e-4  # only the KV-cache decoding's float rounding differs
    assert m["mismatch/prob_error"] < 1 + 1e-5 and m["mismatch/tis_clip_frac"] == 0


@pytest.mark.parametrize("recipe, rollout", [("bf16", "fp8"), ("blockwise", "high")])
def test_different_quantization_is_measured(tiny_tokenizer, recipe, rollout):
    m = _mismatch(recipe, rollout, tiny_tokenizer)  # FP8 on one side only
    assert m["mismatch/abs_dlogp_mean"] > 1e-3
    assert 1.0 < m["mismatch/prob_error"] < 1.2 and m["mismatch/k3_kl"] > 0


def test_sampling_is_reproducible_from_the_seed(tiny_tokenizer):
    engine = _engine(prepare_for_training(make_tiny_model(), "blockwise"), tiny_tokenizer, "fp8")
    prompts = [tiny_tokenizer(p)["input_ids"] for p in PROMPTS]
    a, b, c = (engine.generate(prompts, 2, seed=s) for s in (5, 5, 6))
    ids = [[r.response_ids for r in g] for g in a]
    assert ids == [[r.response_ids for r in g] for g in b]
    assert ids != [[r.response_ids for r in g] for g in c]
    assert all(len(r.response_ids) == len(r.logprobs) <= 12 for g in a for r in g)
    assert all(r.finished == (r.response_ids[-1] in stop_token_ids(tiny_tokenizer)) for g in a for r in g)


def test_greedy_decoding_matches_transformers_generate(tiny_tokenizer):
    model = make_tiny_model(seed=3)
    engine = _engine(prepare_for_training(make_tiny_model(seed=3), "bf16"), tiny_tokenizer, "high")
    prompts = [tiny_tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    mine = [g[0].response_ids for g in engine.generate(prompts, 1, seed=0, greedy=True)]
    stops = stop_token_ids(tiny_tokenizer)
    for p, ids in zip(prompts, mine, strict=True):
        out = model.eval().generate(
            input_ids=torch.tensor([p]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=stops[0],
        )
        assert ids == out[0, len(p) :].tolist()  # transformers' own greedy decoding, one prompt at a time


def test_a_prompts_samples_do_not_depend_on_their_batch(tiny_tokenizer):
    """What a run split over ranks relies on: prompt i's group depends on its seed, not on which other
    prompts were generated with it or on the batch size (rl.loop gives each rank a share of the prompts)."""
    policy = prepare_for_training(make_tiny_model(), "blockwise")
    prompts = [tiny_tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    seeds = derive_seeds(7, len(prompts))
    together = _engine(policy, tiny_tokenizer, "fp8").generate(prompts, 3, seeds)
    apart = _engine(policy, tiny_tokenizer, "fp8", batch_size=2)
    for i in range(len(prompts)):
        alone = apart.generate(prompts[i : i + 1], 3, seeds[i : i + 1])[0]
        assert [r.response_ids for r in alone] == [r.response_ids for r in together[i]]
        for r, t in zip(alone, together[i], strict=True):
            assert r.logprobs == pytest.approx(t.logprobs, abs=1e-5)
    assert together == _engine(policy, tiny_tokenizer, "fp8").generate(prompts, 3, 7)  # an int: derive_seeds
    assert len({tuple(r.response_ids) for g in together for r in g}) > 3  # the samples do differ


def test_fp8_rollouts_of_an_moe_policy_run_the_experts_on_the_exports_bytes(tmp_path, tiny_tokenizer):
    """Each routed expert's FP8 weight in the rollout engine is the one `export_model(fmt="fp8")` writes
    for it (per expert: gate and up as the checkpoint layout splits them, and down), after an update too,
    with fp32 block scales on a policy trained with power-of-two ones (so the training recipe's own
    quantization would differ); high-precision rollouts run the experts in high precision."""
    from safetensors.torch import load_file

    from infir2.nn.moe import Fp8Experts
    from moe_models import make_tiny_moe

    policy = prepare_for_training(make_tiny_moe("qwen3_moe"), "blockwise")
    engine = BuiltinEngine(
        policy,
        tiny_tokenizer,
        precision="fp8",
        scale_encoding="fp32",
        model_precision="fp32",
        copy_model=True,
    )
    for step in range(2):
        out = export_model(policy, None, tmp_path / f"fp8-{step}", fmt="fp8", scale_encoding="fp32")
        exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
        served = [(n, m) for n, m in engine.model.named_modules() if isinstance(m, Fp8Experts)]
        assert len(served) == 2 and all(m.fp8_enabled for _, m in served)
        for fqn, experts in served:
            gate_up = experts.quantized_weights("gate_up_proj", experts.kernels)
            down = experts.quantized_weights("down_proj", experts.kernels)
            half = gate_up[0].data.shape[0] // 2
            for e, (gu, d) in enumerate(zip(gate_up, down, strict=True)):
                parts = {"gate_proj": gu.data[:half], "up_proj": gu.data[half:], "down_proj": d.data}
                for proj, codes in parts.items():
                    ref = exported[f"{fqn}.{e}.{proj}.weight"]
                    assert torch.equal(codes.view(torch.uint8), ref.view(torch.uint8)), (fqn, e, proj)
        with torch.no_grad():  # an update, then the engine takes the new weights
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        engine.load_weights(policy)
    high = BuiltinEngine(policy, tiny_tokenizer, precision="high", model_precision="fp32", copy_model=True)
    assert not any(m.fp8_enabled for m in high.model.modules() if isinstance(m, Fp8Experts))
