"""The planner's bytes of quantized weights and rows, by the recipe's cast (issue 45: NVFP4 keeps two E2M1
codes a byte, an E4M3 scale per 16x16 block and an fp32 scale per tensor), against the bytes the
quantizers themselves return for a real layer's weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_tiny_model
from infir2.fp8 import RECIPES
from infir2.fp8.nvfp4 import pack_nibbles, quantize_nvfp4
from infir2.fp8.quantize import quantize
from infir2.planning import ModelShape, plan
from infir2.planning.layer import layer_figures
from infir2.planning.quantized import layer_weight_bytes, row_bytes
from train_synthetic import one_thread

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _model():
    """Widths that are no multiple of 128 (hidden 96, MLP 200, heads of 48): partial edge blocks count."""
    return make_tiny_model("llama", hidden=96, layers=2, heads=2, kv_heads=1, head_dim=48, intermediate=200)


def _shape(model) -> ModelShape:
    return ModelShape.from_config(model.config.to_dict(), "<tiny>")


def _quantized_bytes(w: torch.Tensor, recipe: str) -> int:
    """What the recipe's weight cast makes of ``w``, counted on the tensors the quantizer returns."""
    cast = RECIPES[recipe].w
    if cast.is_fp4:
        codes, block_scale, tensor_scale = quantize_nvfp4(w, tuple(cast.block))
        return pack_nibbles(codes).nbytes + block_scale.nbytes + tensor_scale.nbytes
    data, scale = quantize(w, tuple(cast.block), cast.fmt, cast.scale_encoding)
    return data.nbytes + scale.nbytes


def _linears(model) -> list[torch.Tensor]:
    layer = model.model.layers[0]
    return [m.weight.detach() for m in layer.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8", "tensorwise", "nvfp4", "nvfp4_4over6"])
def test_a_layers_weight_bytes_are_what_the_quantizer_returns(recipe: str) -> None:
    model = _model()
    counted = sum(_quantized_bytes(w, recipe) for w in _linears(model))
    assert layer_weight_bytes(_shape(model), RECIPES[recipe].w) == counted


def test_nvfp4_weight_copies_are_half_a_byte_plus_scales() -> None:
    """The weight copy one NVFP4 layer keeps for the step (measured on its forward) == the quantizer's
    codes + 16x16 E4M3 scales + the fp32 tensor scale of each projection: ~0.53 byte per weight."""
    model = _model()
    shape = _shape(model)
    counted = sum(_quantized_bytes(w, "nvfp4") for w in _linears(model))
    assert layer_figures(shape, "nvfp4", device="cpu")[1] == counted
    assert 0.5 * shape.projection_weights < counted < 0.54 * shape.projection_weights


def test_the_all_gather_counts_the_weight_casts_bytes() -> None:
    """Two GPUs: a recipe that gathers FP8 weights gathers its cast's codes + scales (blockwise: partial
    128x128 edge blocks; tensorwise, asked for: one fp32 scale per tensor); NVFP4's are gathered in
    bf16 (the whole tensor's amax comes first), even when param_gather is asked for."""
    model = _model()
    shape = _shape(model)
    base = plan(shape, "bf16", gpus=2, seq_len=256)
    for recipe, param_gather in (("blockwise", None), ("tensorwise", True)):
        quantized = layer_weight_bytes(shape, RECIPES[recipe].w)
        assert quantized == sum(_quantized_bytes(w, recipe) for w in _linears(model))
        saved = shape.layers * (2 * shape.projection_weights - quantized)  # bf16 minus FP8, per pass
        fp8 = plan(shape, recipe, gpus=2, seq_len=256, param_gather=param_gather)
        assert base.all_gather - fp8.all_gather == pytest.approx(2 * saved / 2)  # fwd + bwd, half each
    for param_gather in (None, True):
        nv = plan(shape, "nvfp4", gpus=2, seq_len=256, param_gather=param_gather)
        assert nv.all_gather == base.all_gather


def test_routed_rows_of_an_moe_layer_count_the_saved_cast() -> None:
    """The experts' extra copy of each routed row: the x_wgrad cast's codes and scales (NVFP4: 0.5 byte
    + an E4M3 scale per 16 tokens; blockwise: 1 byte + an fp32 scale per 128 tokens)."""
    x = torch.randn(256, 96)
    for recipe in ("blockwise", "nvfp4"):
        cast = RECIPES[recipe].x_wgrad
        if cast.is_fp4:
            codes, scale, _tensor = quantize_nvfp4(x, tuple(cast.block))
            measured = pack_nibbles(codes.t().contiguous()).nbytes + scale.nbytes  # the tensor scale: once
        else:
            data, scale = quantize(x, tuple(cast.block), cast.fmt, cast.scale_encoding)
            measured = data.nbytes + scale.nbytes
        assert row_bytes(cast, 96) * 256 == measured, recipe
    dense = ModelShape(96, 200, 2, 2, 1, 300, False, head_dim=48)
    moe = dataclasses.replace(dense, experts=4, expert_intermediate=100, top_k=2, intermediate=100)
    extra = layer_figures(moe, "nvfp4", device="cpu")[0] - layer_figures(dense, "nvfp4", device="cpu")[0]
    assert extra == row_bytes(RECIPES["nvfp4"].x_wgrad, 96)  # one extra row (top-2) per token
