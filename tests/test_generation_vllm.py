"""The vllm engine's parts that need no vLLM (the main suite): its registry entry, the FP8 refusal where
vLLM cannot run block FP8, and the byte comparison of what vLLM holds with the FP8 export's tensors."""

from __future__ import annotations

import pytest
import torch

from infir2.export.layout import quantize_weight
from infir2.generation import ENGINES, check_engine
from infir2.generation.vllm_engine import (
    VllmEngine,
    VllmSettings,
    check_fp8_bytes,
    check_served_dtype,
    fp8_unsupported,
    served_dtype,
)
from infir2.generation.vllm_fp8 import check_fp8_values, dequantize_export, dequantized_weights
from infir2.rl import parse_rl_config


def test_the_registry_knows_vllm_as_an_in_process_engine_with_token_ids():
    traits = ENGINES["vllm"].traits
    assert traits is not None and traits.in_process and traits.returns_ids
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
        {**base, "rollout": {"engine": "vllm", "precision": "high"}, "engine": {"max_model_len": 64}}
    )
    assert cfg.engine == VllmSettings(max_model_len=64)  # the section is the engine's own settings type
    with pytest.raises(ValueError, match=r"memory_fraction in \(0, 1\]"):
        parse_rl_config(
            {**base, "rollout": {"engine": "vllm", "precision": "high"}, "engine": {"memory_fraction": 2}}
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
    assert main([*argv, "--dtype", "float32", "--precision", "fp8"]) == 2  # FP8 refused first: no AMX
    monkeypatch.setattr(v, "fp8_unsupported", lambda: None)  # as if AMX or a GPU
    assert main([*argv, "--dtype", "float32", "--precision", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "--dtype float32: vLLM's FP8 takes bfloat16 or float16 activations; use --dtype auto" in err
    builtin = ["eval", "--model", str(tmp_path / "absent"), "--out", str(tmp_path / "out")]
    assert main([*builtin, "--dtype", "bfloat16"]) == 2
    assert "--dtype is a flag of --engine vllm, not of --engine builtin" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_served_dtype_is_what_the_precision_word_means_on_the_builtin_engine(monkeypatch):
    """auto: bfloat16 for FP8 (vLLM's FP8 takes bf16 activations, whatever the policy), model.precision's
    dtype in RL, and in evaluation the dtype the builtin engine loads a model in (float32 on a CPU,
    bfloat16 on CUDA: load_checkpoint); a dtype given is served as given."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert served_dtype(VllmSettings(), fp8=False)[0] == "float32"
    assert served_dtype(VllmSettings(), fp8=True)[0] == "bfloat16"
    for word, dtype in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp64", "float64")):
        assert served_dtype(VllmSettings(), fp8=False, model_precision=word)[0] == dtype
        assert served_dtype(VllmSettings(), fp8=True, model_precision=word)[0] == "bfloat16"
    assert served_dtype(VllmSettings(dtype="float16"), fp8=False, model_precision="fp32") == (
        "float16",
        "as set",
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert served_dtype(VllmSettings(), fp8=False)[0] == "bfloat16"
    with pytest.raises(
        ValueError, match=r"vllm: dtype must be one of auto, float32, bfloat16, float16, got 'fp32'"
    ):
        VllmSettings(dtype="fp32")


def test_a_dtype_vllm_cannot_serve_is_refused_in_one_line_saying_what_would(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cases = [
        (
            ("float32", True, "vllm.dtype"),
            "vllm.dtype float32: vLLM's FP8 takes bfloat16 or float16 activations; use vllm.dtype auto or bfloat16",
        ),
        (
            ("float16", True, "--dtype"),
            "--dtype float16: vLLM's CPU FP8 kernel takes bfloat16 activations; use --dtype bfloat16",
        ),
        (
            ("float64", False, "vllm.dtype", None, "model.precision fp64"),
            "vllm.dtype auto means float64 here (model.precision fp64): vLLM cannot serve it",
        ),
        (
            ("bfloat16", False, "--dtype", ["float16", "float32"]),
            "--dtype bfloat16: vLLM cannot serve it on this device (it serves float16, float32 here); set --dtype float16",
        ),
    ]
    for args, start in cases:
        with pytest.raises(ValueError) as e:
            check_served_dtype(*args)
        assert str(e.value).startswith(start) and "\n" not in str(e.value), str(e.value)
    check_served_dtype("float32", False, "--dtype", ["bfloat16", "float16", "float32"])  # served: no error
    check_served_dtype("bfloat16", True, "--dtype", ["bfloat16", "float16", "float32"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_served_dtype("float16", True, "--dtype")  # FP8 with fp16 activations: a GPU serves it


def test_rl_refuses_a_served_dtype_vllm_cannot_serve_before_any_model(monkeypatch):
    import infir2.generation.vllm_engine as v

    monkeypatch.setattr(v, "require_vllm", lambda key="engine": None)  # as if installed
    monkeypatch.setattr(v, "fp8_unsupported", lambda: None)  # as if AMX or a GPU
    monkeypatch.setattr(v, "supported_dtypes", lambda: ["bfloat16", "float16", "float32"])
    base = {"data": {"prompts_path": "p.jsonl"}, "rollout": {"engine": "vllm", "precision": "fp8"}}
    with pytest.raises(ValueError, match=r"^rl\.yaml: engine\.dtype float32: vLLM's FP8 takes bfloat16"):
        parse_rl_config({**base, "engine": {"dtype": "float32"}}, "rl.yaml")
    parse_rl_config({**base, "model": {"precision": "fp32"}}, "rl.yaml")  # auto: bfloat16 for FP8
    high = {**base, "rollout": {"engine": "vllm", "precision": "high"}, "model": {"precision": "fp64"}}
    with pytest.raises(
        ValueError, match=r"^rl\.yaml: engine\.dtype auto means float64 here \(model\.precision fp64"
    ):
        parse_rl_config(high, "rl.yaml")
    parse_rl_config({**high, "engine": {"dtype": "float32"}}, "rl.yaml")  # said how: accepted


def test_the_builtin_engine_says_the_dtype_it_computes_in():
    from conftest import make_tiny_model, make_tokenizer
    from infir2.generation import BuiltinEngine

    model = make_tiny_model()
    assert BuiltinEngine(model, make_tokenizer()).served_dtype == "float32"
    assert BuiltinEngine(model, make_tokenizer(), model_precision="bf16").served_dtype == "bfloat16"
    assert BuiltinEngine(model.double(), make_tokenizer()).served_dtype == "float64"


def _fused_export() -> dict[str, torch.Tensor]:
    """One layer's FP8 projections as the export writes them (codes, pow2 block scales)."""
    torch.manual_seed(0)
    shapes = {"q_proj": (256, 128), "k_proj": (128, 128), "v_proj": (128, 128), "o_proj": (128, 256)}
    shapes |= {"gate_proj": (256, 128), "up_proj": (256, 128), "down_proj": (128, 256)}
    exported = {}
    for proj, shape in shapes.items():
        kind = "self_attn" if proj[0] in "qkvo" else "mlp"
        data, scale_inv = quantize_weight(torch.randn(shape) * 0.05, "pow2")
        exported[f"model.layers.0.{kind}.{proj}.weight"] = data
        exported[f"model.layers.0.{kind}.{proj}.weight_scale_inv"] = scale_inv
    return exported


class _RepackedFp8Method:
    """A stand-in for vLLM's AMX block-FP8 linear: the codes held permuted (not the export's layout), the
    product computed from them in fp32 and returned in the input's dtype, as the kernel's output."""

    def __init__(self, codes: torch.Tensor, scale_inv: torch.Tensor, perm: torch.Tensor) -> None:
        self.scale_inv, self.perm = scale_inv, perm

    def apply(self, layer, x, bias=None):
        held = layer.weight.view(torch.float8_e4m3fn).float()  # codes held as bytes of another dtype too
        codes = torch.empty_like(held)
        codes.view(-1)[self.perm] = held.view(-1)  # un-permuted where it computes
        w = dequantize_export(codes.to(torch.float8_e4m3fn), self.scale_inv)
        return (x.float() @ w.T).to(x.dtype)


def _put(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """``module`` at the dotted ``name`` under ``root`` (the folders above made as plain modules)."""
    *path, last = name.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    root.add_module(last, module)


def test_the_dequantized_read_back_checks_a_repacked_layout_by_its_values():
    """The codes vLLM holds on AMX are repacked (bytes of another layout): read back through the layer's
    own kernel (the identity in, 128 rows at a time), the values equal the export's codes x scales,
    whatever the layout; a changed code is named with its gap, a missing layer as inf."""
    exported = _fused_export()
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    fused = {
        f"{attn}.qkv_proj": [f"{attn}.{p}" for p in ("q_proj", "k_proj", "v_proj")],
        f"{attn}.o_proj": [f"{attn}.o_proj"],
        f"{mlp}.gate_up_proj": [f"{mlp}.gate_proj", f"{mlp}.up_proj"],
        f"{mlp}.down_proj": [f"{mlp}.down_proj"],
    }
    model = torch.nn.Module()
    for name, parts in fused.items():
        codes = torch.cat([exported[f"{p}.weight"] for p in parts])
        scale_inv = torch.cat([exported[f"{p}.weight_scale_inv"] for p in parts])
        perm = torch.randperm(codes.numel())
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(codes.view(-1)[perm].view(codes.shape), requires_grad=False)
        layer.input_size, layer.params_dtype = codes.shape[1], torch.bfloat16
        layer.quant_method = _RepackedFp8Method(codes, scale_inv, perm)
        if name.endswith("down_proj"):  # repacked into bytes: a block-FP8 layer by its block scales
            layer.weight = torch.nn.Parameter(layer.weight.data.view(torch.uint8), requires_grad=False)
            layer.weight_scale_inv = scale_inv
        _put(model, name, layer)
    held = dequantized_weights(model, chunk=128)
    assert sorted(held) == sorted(f"{n}.weight" for n in fused)
    assert check_fp8_bytes(held, exported)  # the bytes cannot be compared ...
    assert check_fp8_values(held, exported, torch.bfloat16) == {}  # ... the values can
    qkv = model.get_submodule(f"{attn}.qkv_proj")
    where = (qkv.quant_method.perm == 300 * 128 + 5).nonzero().item()  # one code of k_proj (rows 256..383)
    qkv.weight.view(torch.uint8).view(-1)[where] ^= 8
    held = dequantized_weights(model, chunk=128)
    del held[f"{mlp}.down_proj.weight"]
    gaps = check_fp8_values(held, exported, torch.bfloat16)
    assert gaps.keys() == {f"{attn}.qkv_proj.weight", f"{mlp}.down_proj.weight"}, gaps
    assert gaps[f"{mlp}.down_proj.weight"] == float("inf") and 0 < gaps[f"{attn}.qkv_proj.weight"] < 1
