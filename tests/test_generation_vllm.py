"""The vllm engine's parts that need no vLLM (the main suite): its registry entry, the FP8 refusal where
vLLM cannot run block FP8, and the byte comparison of what vLLM holds with the FP8 export's tensors."""

from __future__ import annotations

import pytest
import torch

from infir2.export.layout import quantize_weight
from infir2.generation import TRAITS, check_engine
from infir2.generation.vllm_engine import VllmEngine, VllmSettings, check_fp8_bytes, fp8_unsupported
from infir2.rl import parse_rl_config


def test_the_registry_knows_vllm_as_an_in_process_engine_with_token_ids():
    assert TRAITS["vllm"].in_process and TRAITS["vllm"].returns_ids
    check_engine("vllm", "rollout.engine", "fp8", "rollout.precision", needs_ids=True)
    with pytest.raises(ValueError, match=r"--precision: the vllm engine cannot run a training recipe's FP8"):
        check_engine("vllm", "--engine", "recipe", "--precision")


def test_fp8_on_a_cpu_without_amx_is_refused_naming_the_reason_and_the_alternatives(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    why = fp8_unsupported()
    assert why is not None and "needs AMX tiles" in why
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "fp8"}}')
    with pytest.raises(ValueError) as e:  # an FP8 export folder: refused before vLLM is imported
        VllmEngine(None, VllmSettings(), folder=tmp_path)
    line = str(e.value)
    assert line.startswith(
        "--model: the vllm engine cannot run FP8 here: vLLM's CPU block-FP8 kernel needs AMX"
    )
    assert (
        "rollout.precision: high" in line and "--engine builtin --precision fp8" in line and "\n" not in line
    )
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert fp8_unsupported() is None


def test_rl_refuses_fp8_rollouts_on_vllm_where_vllm_cannot_serve_them(monkeypatch):
    import infir2.generation.vllm_engine as v

    monkeypatch.setattr(v, "require_vllm", lambda key="engine": None)  # as if installed
    monkeypatch.setattr(v, "fp8_unsupported", lambda: "no AMX here")
    base = {"data": {"prompts_path": "p.jsonl"}, "rollout": {"engine": "vllm"}}
    with pytest.raises(
        ValueError, match=r"^rl\.yaml: rollout\.precision: the vllm engine cannot run FP8 here: no AMX"
    ):
        parse_rl_config({**base, "rollout": {"engine": "vllm", "precision": "fp8"}}, "rl.yaml")
    cfg = parse_rl_config(
        {**base, "rollout": {"engine": "vllm", "precision": "high"}, "vllm": {"max_model_len": 64}}
    )
    assert cfg.vllm.settings() == VllmSettings(max_model_len=64)
    with pytest.raises(ValueError, match=r"memory_fraction in \(0, 1\]"):
        parse_rl_config(
            {**base, "rollout": {"engine": "vllm", "precision": "high"}, "vllm": {"memory_fraction": 2}}
        )


def test_the_bytes_vllm_holds_compare_with_the_exports_through_its_fused_layers():
    """q/k/v fused into qkv_proj and gate/up into gate_up_proj (output rows concatenated, in that order):
    equal bytes give [], one changed code or scale is named, a repacked (other shape) layout is named."""
    torch.manual_seed(0)
    shapes = {"q_proj": (256, 128), "k_proj": (128, 128), "v_proj": (128, 128), "o_proj": (128, 256)}
    shapes |= {"gate_proj": (256, 128), "up_proj": (256, 128), "down_proj": (128, 256)}
    exported = {}
    for proj, shape in shapes.items():
        kind = "self_attn" if proj[0] in "qkvo" else "mlp"
        data, scale_inv = quantize_weight(torch.randn(shape), "pow2")
        exported[f"model.layers.0.{kind}.{proj}.weight"] = data
        exported[f"model.layers.0.{kind}.{proj}.weight_scale_inv"] = scale_inv
    exported["model.norm.weight"] = torch.ones(128)  # not FP8: not compared
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    held = {}
    for fused, parts in (
        (f"{attn}.qkv_proj", [f"{attn}.{p}" for p in ("q_proj", "k_proj", "v_proj")]),
        (f"{mlp}.gate_up_proj", [f"{mlp}.gate_proj", f"{mlp}.up_proj"]),
    ):
        for suffix in ("weight", "weight_scale_inv"):
            held[f"{fused}.{suffix}"] = torch.cat([exported[f"{p}.{suffix}"] for p in parts]).clone()
    for name in (f"{attn}.o_proj", f"{mlp}.down_proj"):
        for suffix in ("weight", "weight_scale_inv"):
            held[f"{name}.{suffix}"] = exported[f"{name}.{suffix}"].clone()
    assert check_fp8_bytes(held, exported) == []
    codes = held[f"{attn}.qkv_proj.weight"].view(torch.uint8)
    codes[300, 5] ^= 1  # one code of k_proj (rows 256..383 of the fused weight)
    held[f"{mlp}.down_proj.weight_scale_inv"][0, 0] *= 2
    held[f"{mlp}.gate_up_proj.weight"] = held[f"{mlp}.gate_up_proj.weight"].reshape(128, -1)  # repacked
    assert sorted(check_fp8_bytes(held, exported)) == sorted(
        [f"{attn}.qkv_proj.weight", f"{mlp}.down_proj.weight_scale_inv", f"{mlp}.gate_up_proj.weight"]
    )


def test_eval_refuses_fp8_on_vllm_here_in_one_line_before_any_weights(monkeypatch, tmp_path, capsys):
    import infir2.generation.vllm_engine as v
    from infir2.cli import main

    monkeypatch.setattr(v, "require_vllm", lambda key="engine": None)  # as if installed
    monkeypatch.setattr(v, "fp8_unsupported", lambda: "no AMX here")
    argv = ["eval", "--engine", "vllm", "--model", str(tmp_path / "absent"), "--out", str(tmp_path / "out")]
    assert main([*argv, "--precision", "fp8"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "--precision: the vllm engine cannot run FP8 here: no AMX here" in err[0], err
    assert main([*argv, "--max-model-len", "1"]) == 2
    assert "max_model_len must be >= 2" in capsys.readouterr().err
    assert main([*argv, "--device", "cpu"]) == 2
    assert "--device is not a flag of --engine vllm" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
