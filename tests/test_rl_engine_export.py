"""FP8 rollouts are the FP8 export: the rollout engine's log-probabilities against an independent forward
of the folder `infir2 export --format fp8` writes (bf16 base dtype, its default).

The independent forward reads the folder's safetensors itself: each FP8 projection dequantized here
(codes x the block's ``weight_scale_inv``), every other tensor upcast from its stored dtype, loaded into a
plain transformers model built from the folder's ``config.json``, and each projection's input quantized
1x128 per token with power-of-two scales by the rule of docs/RECIPE.md written out below (not the
project's quantizer). No code of ``infir2.generation`` or ``infir2.export.load`` runs in it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_tiny_model
from infir2.cli import main
from infir2.export import export_model
from infir2.generation import BuiltinEngine, RolloutEngine, SamplingConfig
from infir2.model import prepare_for_training
from train_synthetic import one_thread

pytestmark = pytest.mark.transformers_api  # builds a transformers model from a config
_one_thread = pytest.fixture(autouse=True)(one_thread)


PROMPTS = ["Compute 7 + 5 - 3.", "The quick brown fox", "12 + 30 = ", "9 - 4 + 2"]
E4M3_MAX = 448.0


def _quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] quantized and dequantized per 1x128 tile: scale = 2^floor(log2(448 / amax)), e4m3."""
    t, k = x.shape
    tiles = torch.nn.functional.pad(x, (0, -k % 128)).reshape(t, -1, 128)
    amax = tiles.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (tiles * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() / scale
    return q.reshape(t, -1)[:, :k]


def _independent_model(folder):
    """The export folder as a transformers model (fp32 arithmetic) with FP8 activations on its projections."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(f)
    state, fp8 = {}, []
    for name, t in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = tensors[name + "_scale_inv"]
            n, k = t.shape
            blocks = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
            state[name] = t.float() * blocks
            fp8.append(name.removesuffix(".weight"))
        else:
            state[name] = t.float()
    cfg = AutoConfig.from_pretrained(folder)
    cfg.quantization_config = None
    del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    model.load_state_dict(state, strict=True)
    for name in fp8:
        model.get_submodule(name).register_forward_pre_hook(
            lambda _m, args: (_quantize_rows(args[0].reshape(-1, args[0].shape[-1])).reshape(args[0].shape),)
        )
    return model, tensors


def _engine(policy, tok, base_dtype):
    builtin = BuiltinEngine(
        policy, tok, precision="fp8", model_precision="fp32", copy_model=True, base_dtype=base_dtype
    )
    return RolloutEngine(builtin, SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=12, batch_size=8))


def _dlogp(engine, reference, tok) -> torch.Tensor:
    """|logp_engine - logp_reference| of every sampled response token (one sequence per forward)."""
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    diffs = []
    for prompt, group in zip(prompts, engine.generate(prompts, 4, seed=3), strict=True):
        for sample in group:
            ids = torch.tensor([prompt + sample.response_ids])
            with torch.no_grad():
                logits = reference(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
            logp = logits.log_softmax(-1).gather(1, torch.tensor(sample.response_ids)[:, None])[:, 0]
            diffs.append((logp - torch.tensor(sample.logprobs, dtype=torch.float64)).abs())
    return torch.cat(diffs)


def test_fp8_rollouts_score_as_an_independent_forward_of_the_fp8_export(tmp_path, tiny_tokenizer):
    policy = prepare_for_training(make_tiny_model(seed=5), "blockwise")
    with torch.no_grad():  # norms away from 1 (their bf16 rounding then shows), embeddings as trained
        for name, p in policy.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    src = export_model(policy, tiny_tokenizer, tmp_path / "fp32", fmt="fp32")
    folder = tmp_path / "fp8"
    assert main(["export", "--model", str(src), "--out", str(folder), "--format", "fp8"]) == 0
    reference, tensors = _independent_model(folder)
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16  # the export's default base dtype
    served = _dlogp(_engine(policy, tiny_tokenizer, torch.bfloat16), reference, tiny_tokenizer)
    trainers = _dlogp(_engine(policy, tiny_tokenizer, None), reference, tiny_tokenizer)
    assert len(served) > 50
    # the engine's KV-cached decoding against a full forward: float rounding (and, rarely, one activation
    # on the other side of an FP8 rounding boundary), nothing systematic
    assert float(served.median()) < 1e-5 and float(served.mean()) < 1e-4, float(served.mean())
    # the trainer's fp32 embeddings / norms / lm_head are a different model from the export
    assert float(trainers.mean()) > 20 * max(float(served.mean()), 1e-6), float(trainers.mean())
