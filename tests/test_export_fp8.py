"""FP8 / BF16 / FP32 export: round trips, the DeepSeek-V3 layout, streaming conversion, reload in transformers."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import make_tiny_model
from infir2 import sqnr
from infir2.cli import main
from infir2.export import (
    QUANTIZATION_CONFIG,
    CheckpointReader,
    convert_checkpoint,
    export_model,
    load_checkpoint,
    load_fp8_state_dict,
)
from infir2.fp8 import dequantize
from infir2.nn import DECODER_PROJECTIONS

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

HIDDEN = 160  # intermediate = 2*160+128 = 448: partial 128-blocks on both axes of the MLP weights


def _read_folder(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open has no __iter__)
    return out


def _is_projection(name: str) -> bool:
    return any(f".{p}.weight" in name for p in DECODER_PROJECTIONS)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_tiny_model(hidden=HIDDEN)


@pytest.mark.parametrize("encoding", ["pow2", "fp32"])
def test_fp8_export_layout_and_round_trip(model, tiny_tokenizer, tmp_path: Path, encoding: str) -> None:
    pow2_scale = encoding == "pow2"
    out = export_model(
        model,
        tiny_tokenizer,
        tmp_path / "fp8",
        fmt="fp8",
        scale_encoding=encoding,
        base_dtype=torch.float32,
        max_shard_size="150KB",
    )
    saved, original = _read_folder(out), model.state_dict()
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {**QUANTIZATION_CONFIG, "modules_to_not_convert": ["lm_head"]}
    assert config["architectures"] == [type(model).__name__]  # serving engines pick the model class from it
    assert QUANTIZATION_CONFIG == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    projections = [k for k in original if _is_projection(k)]
    assert len(projections) == 7 * 2
    assert set(saved) == set(original) | {k + "_scale_inv" for k in projections}
    for name, ref in original.items():
        if name not in projections:  # embeddings, lm_head, norms, biases: bit-identical
            assert saved[name].dtype == ref.dtype and torch.equal(saved[name], ref), name
            continue
        data, scale_inv = saved[name], saved[name + "_scale_inv"]
        n, k = ref.shape
        assert data.dtype == torch.float8_e4m3fn and data.shape == ref.shape
        assert scale_inv.dtype == torch.float32 and scale_inv.shape == (
            math.ceil(n / 128),
            math.ceil(k / 128),
        )
        mantissa = torch.frexp(scale_inv).mantissa
        assert bool((mantissa == 0.5).all()) is pow2_scale, (
            "pow2 scales are powers of two, fp32 scales are not"
        )
        back = dequantize(data, scale_inv, (128, 128))
        assert sqnr(ref, back) >= 25, name


def test_index_json_is_consistent(model, tiny_tokenizer, tmp_path: Path) -> None:
    out = export_model(model, tiny_tokenizer, tmp_path / "fp8", fmt="fp8", max_shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    total = 0
    for file in files:
        with safe_open(str(out / file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                assert index["weight_map"][key] == file
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}


def test_fp32_export_reloads_in_transformers_with_identical_logits(
    model, tiny_tokenizer, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infir2.data.tokenizer import load_tokenizer

    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    run_tokenizer = load_tokenizer(tmp_path / "tok", model_type="qwen2")  # as a qwen2 run reads it
    out = export_model(model, run_tokenizer, tmp_path / "fp32", fmt="fp32", max_shard_size="200KB")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model.eval()(ids).logits)
    for tok in (load_tokenizer(out), AutoTokenizer.from_pretrained(out)):
        assert tok.encode("12 + 30 = 42. DON'T") == run_tokenizer.encode("12 + 30 = 42. DON'T")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [
        tiny_tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tiny_tokenizer.eos_token_id,
    ]


def test_bf16_export_reloads_close(model, tiny_tokenizer, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = export_model(model, tiny_tokenizer, tmp_path / "bf16", fmt="bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in _read_folder(out).values())
    reloaded = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32
    ).eval()  # fp32 compute: fast on CPU
    rounded = make_tiny_model(hidden=HIDDEN)
    rounded.load_state_dict({k: v.bfloat16().float() for k, v in model.state_dict().items()})
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, ref = reloaded(ids).logits, model.eval()(ids).logits
        assert torch.equal(got, rounded.eval()(ids).logits)  # exactly the bf16-rounded weights
    assert sqnr(ref, got) > 30


def test_streaming_conversion_of_a_multi_shard_checkpoint(model, tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "hf"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(src, max_shard_size="100KB")
    assert len(list(src.glob("*.safetensors"))) > 2
    originals = _read_folder(src)
    open_shards: list[int] = []
    real_get = CheckpointReader.get

    def spying_get(self, name):
        out = real_get(self, name)
        open_shards.append(len(self._handles))
        return out

    monkeypatch.setattr(CheckpointReader, "get", spying_get)
    out = convert_checkpoint(src, tmp_path / "fp8", fmt="fp8", max_shard_size="60KB")
    assert open_shards and max(open_shards) == 1, "one input shard open at a time"
    saved = _read_folder(out)
    for name, ref in originals.items():
        if _is_projection(name):
            expected, _ = _quantize_ref(ref)
            assert torch.equal(saved[name].view(torch.uint8), expected.view(torch.uint8)), name
        else:
            assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], ref), name
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG and config["dtype"] == "bfloat16"
    assert (out / "generation_config.json").is_file()
    with pytest.raises(ValueError, match="already an FP8 checkpoint"):
        convert_checkpoint(out, tmp_path / "again", fmt="fp8")


def _quantize_ref(w: torch.Tensor):
    from infir2.fp8 import quantize

    return quantize(w, (128, 128), "e4m3", scale_encoding="pow2")


def test_fp8_folder_loads_back_and_converts_back(model, tiny_tokenizer, tmp_path: Path) -> None:
    out = export_model(model, tiny_tokenizer, tmp_path / "fp8", fmt="fp8", base_dtype=torch.float32)
    state = load_fp8_state_dict(out)
    loaded = load_checkpoint(out)
    assert not hasattr(loaded.config, "quantization_config")
    for name, ref in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], state[name])
        assert sqnr(ref, state[name]) >= 25
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert sqnr(model.eval()(ids).logits, loaded(ids).logits) > 20
    back = convert_checkpoint(out, tmp_path / "bf16", fmt="fp32")
    restored = _read_folder(back)
    assert set(restored) == set(state) and all(torch.equal(restored[k], state[k]) for k in state)
    assert "quantization_config" not in json.loads((back / "config.json").read_text())


@pytest.mark.parametrize(
    ("flags", "pow2"),
    [
        (["--scale-encoding", "pow2"], True),
        (["--scale-encoding", "fp32"], False),
        ([], True),
    ],
)
def test_cli_scale_encoding_parses_both_ways(
    model, tmp_path: Path, caplog, flags: list[str], pow2: bool
) -> None:
    src = tmp_path / "hf"
    model.save_pretrained(src)
    argv = ["export", "--model", str(src), "--out", str(tmp_path / "out"), "--format", "fp8"]
    assert main(argv + flags) == 0
    scales = [t for k, t in _read_folder(tmp_path / "out").items() if k.endswith("_scale_inv")]
    assert scales and all(bool((torch.frexp(s).mantissa == 0.5).all()) is pow2 for s in scales)


def test_the_old_scale_spellings_are_gone(model, tmp_path: Path, capsys) -> None:
    """0.1.0 was never released: --pow2-scale and pow2_scale= are not kept as aliases."""
    src = tmp_path / "hf"
    model.save_pretrained(src)
    argv = ["export", "--model", str(src), "--out", str(tmp_path / "out"), "--format", "fp8"]
    with pytest.raises(SystemExit):
        main([*argv, "--no-pow2-scale"])
    assert "unrecognized arguments: --no-pow2-scale" in capsys.readouterr().err
    with pytest.raises(TypeError, match="pow2_scale"):
        export_model(model, None, tmp_path / "fp8", fmt="fp8", pow2_scale=False)  # type: ignore[call-arg]


def test_cli_errors_are_one_line(tmp_path: Path, capsys) -> None:
    assert main(["export", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert f"model folder {tmp_path / 'nope'} does not exist" in capsys.readouterr().err


def test_export_refuses_a_non_empty_out_unless_overwrite(model, tmp_path: Path, capsys) -> None:
    src = tmp_path / "hf"
    model.save_pretrained(src)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    capsys.readouterr()  # save_pretrained's progress bar
    argv = ["export", "--model", str(src), "--out", str(out), "--format", "bf16"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"output folder {out} is not empty" in err and "--overwrite" in err and len(err.splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine"]  # no temporary folder left
    assert main([*argv, "--overwrite"]) == 0
    assert not (out / "notes.txt").exists() and _read_folder(out)
    assert (
        main(["export", "--model", str(src), "--out", str(tmp_path), "--overwrite"]) == 2
    )  # holds the input
    assert src.is_dir()


def test_a_model_folder_without_weights_is_a_clear_error(model, tmp_path: Path) -> None:
    src = tmp_path / "hf"
    model.config.save_pretrained(src)  # config.json only
    with pytest.raises(FileNotFoundError, match=r"has no weights \(\*\.safetensors"):
        load_checkpoint(src)
    from infir2.model import load_pretrained

    with pytest.raises(FileNotFoundError, match=r"has a config\.json but no weights"):
        load_pretrained(src)


def test_export_of_an_fp8_converted_model_and_existing_output(tiny_tokenizer, tmp_path: Path) -> None:
    from infir2 import convert_to_fp8

    reference = make_tiny_model()
    converted = convert_to_fp8(make_tiny_model())  # Fp8Linear shares the nn.Linear parameters and names
    out = export_model(converted, tiny_tokenizer, tmp_path / "fp32", fmt="fp32")
    saved = _read_folder(out)
    assert set(saved) == set(reference.state_dict())
    assert all(torch.equal(saved[k], v) for k, v in reference.state_dict().items())
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        export_model(converted, tiny_tokenizer, out, fmt="fp32")


@pytest.mark.parametrize("encoding", ["pow2", "fp32"])
def test_transformers_reads_our_fp8_layout(tiny_tokenizer, tmp_path: Path, encoding: str) -> None:
    """Independent reader: transformers' fine-grained FP8 loader (dequantizing on a machine without a GPU).

    Its CPU dequantizer derives the block size from the scale grid, so it needs dimensions that are
    multiples of 128 (true for Qwen2.5 / Llama); hidden=128 here.
    """
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load FP8 checkpoints")
    from transformers import AutoModelForCausalLM

    out = export_model(
        make_tiny_model(hidden=128),
        tiny_tokenizer,
        tmp_path / "fp8",
        fmt="fp8",
        scale_encoding=encoding,
        base_dtype=torch.float32,
    )
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    ours = load_fp8_state_dict(out)
    assert set(theirs) == set(ours)
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name


def _weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def test_fp8_export_of_an_fp32_folder_writes_bf16_beside_the_fp8_projections(
    tiny_tokenizer, tmp_path: Path
) -> None:
    """A CPU run's fp32 folder -> FP8: projections quantized from the fp32 masters, everything else bf16
    (the published FP8 checkpoints' layout), config.json says bfloat16, transformers loads it."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load FP8 checkpoints")
    from transformers import AutoModelForCausalLM

    fp32 = make_tiny_model(hidden=128)
    src = tmp_path / "fp32"
    fp32.save_pretrained(src)
    masters = _read_folder_any(src)
    assert all(t.dtype == torch.float32 for t in masters.values())
    argv = ["export", "--model", str(src), "--format"]
    assert main([*argv, "fp8", "--out", str(tmp_path / "fp8")]) == 0
    assert main([*argv, "bf16", "--out", str(tmp_path / "bf16")]) == 0
    out = tmp_path / "fp8"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    saved = _read_folder(out)
    for name, master in masters.items():
        if _is_projection(name):  # quantized from fp32, not from a bf16 rounding of it
            expected, scale_inv = _quantize_ref(master)
            assert torch.equal(saved[name].view(torch.uint8), expected.view(torch.uint8)), name
            assert torch.equal(saved[name + "_scale_inv"], scale_inv.float()), name
        else:
            assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], master.bfloat16()), name
    # the folder's size: 1 byte per projection weight (+ its scales), 2 per other weight, vs 2 for all
    proj = sum(t.numel() for k, t in masters.items() if _is_projection(k))
    scales = sum(t.numel() for k, t in saved.items() if k.endswith("_scale_inv"))
    total = sum(t.numel() for t in masters.values())
    expected_ratio = (proj + 4 * scales + 2 * (total - proj)) / (2 * total)
    ratio = _weight_bytes(out) / _weight_bytes(tmp_path / "bf16")
    assert abs(ratio - expected_ratio) < 0.01, (ratio, expected_ratio)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    ours = load_fp8_state_dict(out)
    assert set(theirs) >= set(ours) and all(torch.equal(theirs[k], ours[k]) for k in ours)
    # --base-dtype fp32 keeps the fp32 precision of the non-FP8 tensors
    assert main([*argv, "fp8", "--base-dtype", "fp32", "--out", str(tmp_path / "fp8-32")]) == 0
    kept = _read_folder(tmp_path / "fp8-32")
    assert json.loads((tmp_path / "fp8-32" / "config.json").read_text())["dtype"] == "float32"
    assert all(torch.equal(kept[k], t) for k, t in masters.items() if not _is_projection(k))


def test_export_model_quantizes_the_fp32_masters_and_writes_the_rest_in_bf16(
    model, tiny_tokenizer, tmp_path: Path
) -> None:
    out = export_model(model, tiny_tokenizer, tmp_path / "fp8", fmt="fp8")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    saved = _read_folder(out)
    for name, master in model.state_dict().items():
        if _is_projection(name):
            expected, _ = _quantize_ref(master)
            assert torch.equal(saved[name].view(torch.uint8), expected.view(torch.uint8)), name
        elif name in saved:
            assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], master.bfloat16()), name


def _read_folder_any(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def test_whole_blocks_only_keeps_each_fused_group_in_one_precision(tmp_path: Path) -> None:
    """4 query heads and 1 key/value head of 64 at width 256: q_proj [256, 256] is whole 128-blocks,
    k_proj and v_proj [64, 256] are not. vLLM fuses q/k/v into one layer and refuses "some but not all
    shards" quantized, so --whole-blocks-only keeps q_proj in high precision with them; o_proj and the
    MLP (whole blocks, gate/up of one shape) stay FP8. Without the flag every whole-block weight is FP8."""
    from infir2.export import fused_group

    src = tmp_path / "src"
    make_tiny_model(hidden=256, intermediate=384, heads=4, kv_heads=1, layers=1).save_pretrained(src)
    out = convert_checkpoint(src, tmp_path / "whole", whole_blocks_only=True)
    tensors = _read_folder(out)
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    for name in ("q_proj", "k_proj", "v_proj"):
        assert tensors[f"{attn}.{name}.weight"].dtype == torch.bfloat16, name
        assert f"{attn}.{name}.weight_scale_inv" not in tensors
    for name in (f"{attn}.o_proj", f"{mlp}.gate_proj", f"{mlp}.up_proj", f"{mlp}.down_proj"):
        assert tensors[f"{name}.weight"].dtype == torch.float8_e4m3fn, name
    kept = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert {f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"} <= set(kept)
    assert not any(m.endswith(("o_proj", "gate_proj", "up_proj", "down_proj")) for m in kept)
    mixed = _read_folder(convert_checkpoint(src, tmp_path / "mixed"))  # the default: partial blocks FP8
    assert all(mixed[f"{attn}.{n}.weight"].dtype == torch.float8_e4m3fn for n in ("q_proj", "k_proj"))
    groups = {fused_group(f"{attn}.{n}_proj.weight") for n in "qkv"} | {fused_group(f"{mlp}.up_proj.weight")}
    assert groups == {f"{attn}.qkv", f"{mlp}.gate_up"}
    assert fused_group("model.layers.3.block_sparse_moe.experts.7.w3.weight").endswith("experts.7.w13")
    assert fused_group(f"{attn}.o_proj.weight") == f"{attn}.o_proj.weight"
