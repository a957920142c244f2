"""The FP8 export of a trained tiny MoE: per-expert E4M3 weights + 128x128 ``weight_scale_inv`` in the
layout of the published FP8 MoE checkpoints, loaded by transformers (dequantized on CPU) and by
infir2's own loader with the logits of infir2's FP8-weight forward."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open

from conftest import make_tiny_model
from infir2 import convert_to_fp8
from infir2.export import export_model, load_checkpoint
from infir2.export.layout import dequantize_weight, quantize_weight
from infir2.nn import cache_fp8_weights, disable_fp8
from infir2.nn.convert import fp8_weight_names
from moe_models import make_tiny_moe

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

#: the per-expert key of expert 0's gate projection in layer 0, per family (what transformers saves)
GATE_KEY = {
    "qwen3_moe": "model.layers.0.mlp.experts.0.gate_proj.weight",
    "qwen2_moe": "model.layers.0.mlp.experts.0.gate_proj.weight",
    "deepseek_v3": "model.layers.0.mlp.experts.0.gate_proj.weight",
    "mixtral": "model.layers.0.block_sparse_moe.experts.0.w1.weight",
}


def _trained(family: str) -> torch.nn.Module:
    model = make_tiny_moe(family)
    convert_to_fp8(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(step))
        with cache_fp8_weights(model):
            model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def _fp8_weight_reference(model: torch.nn.Module) -> torch.nn.Module:
    """infir2's FP8-weight forward: each FP8 weight (per expert) as its 128x128-block E4M3 codes (quantized
    from the fp32 masters) times scale_inv, the rest as stored (bf16), activations in high precision."""
    ref = copy.deepcopy(model)
    fp8 = fp8_weight_names(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            w = p.detach().float()
            if name in fp8:
                rows = [w] if w.dim() == 2 else list(w)
                w = torch.stack([dequantize_weight(*quantize_weight(r), torch.float32) for r in rows])
                w = w.reshape(p.shape)
            else:
                w = w.to(torch.bfloat16)
            p.copy_(w.float())
    return ref


@pytest.mark.parametrize("family", list(GATE_KEY))
def test_fp8_moe_export_loads_in_transformers_with_infir2_logits(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model = _trained(family)
    out = export_model(model, None, tmp_path / "fp8", fmt="fp8")
    tensors = {}
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    gate = GATE_KEY[family]
    assert tensors[gate].dtype == torch.float8_e4m3fn and tensors[gate].shape == (128, 128)
    assert tensors[gate.replace(".weight", ".weight_scale_inv")].dtype == torch.float32
    experts = [k for k in tensors if ".experts." in k and k.endswith(".weight")]
    assert len(experts) == 2 * 4 * 3 and all(tensors[k].dtype == torch.float8_e4m3fn for k in experts)
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in tensors)  # no fused tensor
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    not_converted = json.loads((out / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"
    ]
    assert "lm_head" in not_converted and "model.layers.0.mlp.gate" in not_converted

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(7))
    with disable_fp8(model):
        expected = _fp8_weight_reference(model)(ids).logits
    # .float(): transformers 5.17 (the floor infir2 admits) leaves Mixtral's router weight in the file's
    # bf16 under dtype=float32 (newer versions cast it); bf16 -> fp32 is exact, and a weight left in FP8
    # would not survive the cast's plain value conversion, so this hides no wrong value
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).float().eval()
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, expected, rtol=0, atol=1e-5)
        assert torch.allclose(load_checkpoint(out)(ids).logits, expected, rtol=0, atol=1e-5)


def test_fp8_export_stores_what_was_converted_phi3_fused_projections(tmp_path):
    """Phi-3's fused qkv_proj / gate_up_proj train in FP8, so they export in FP8 (not by a list of names)."""
    tiny = make_tiny_model(
        "phi3", 256, layers=1, intermediate=256, heads=2, kv_heads=2, max_positions=64, pad_token_id=0
    )
    model = convert_to_fp8(tiny)
    out = export_model(model, None, tmp_path / "fp8", fmt="fp8")
    with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    for proj in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        assert dtypes[f"model.layers.0.{proj}.weight"] == "F8_E4M3", proj
        assert f"model.layers.0.{proj}.weight_scale_inv" in dtypes
    assert dtypes["lm_head.weight"] == "BF16"


def test_folder_conversion_quantizes_per_expert_weights(tmp_path):
    """``infir2 export --model <bf16 MoE folder> --format fp8``: the experts of a checkpoint folder (per-expert
    keys, as transformers saves them) become FP8 too; the router and lm_head do not."""
    from infir2.export import convert_checkpoint

    model = make_tiny_moe("mixtral")
    model.save_pretrained(tmp_path / "bf16")
    out = convert_checkpoint(tmp_path / "bf16", tmp_path / "fp8", "fp8")
    with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    experts = [k for k in dtypes if ".experts." in k and k.endswith(".weight")]
    assert len(experts) == 2 * 4 * 3 and all(dtypes[k] == "F8_E4M3" for k in experts), experts[:3]
    assert all(dtypes[k.replace(".weight", ".weight_scale_inv")] == "F32" for k in experts)
    assert dtypes["model.layers.0.block_sparse_moe.gate.weight"] != "F8_E4M3"
    assert dtypes["lm_head.weight"] != "F8_E4M3"


def test_streamed_export_equals_the_in_memory_one(tmp_path):
    """``tensors=`` (a sharded checkpoint read one tensor at a time): each fused expert tensor is split on
    its own, into the same per-expert FP8 tensors as the whole-state export."""
    model = _trained("qwen3_moe")
    whole = export_model(model, None, tmp_path / "whole", fmt="fp8")
    streamed = export_model(
        model, None, tmp_path / "streamed", fmt="fp8", tensors=iter(model.state_dict().items())
    )

    def read(folder):
        out = {}
        for file in folder.glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
        return out

    a, b = read(whole), read(streamed)
    assert set(a) == set(b) and any(".experts.3.down_proj.weight_scale_inv" in k for k in a)
    for key, value in a.items():
        assert torch.equal(
            value.view(torch.uint8) if value.dtype == torch.float8_e4m3fn else value,
            b[key].view(torch.uint8) if b[key].dtype == torch.float8_e4m3fn else b[key],
        ), key
