"""A recipe's capabilities (``fp8/recipe.py``) say what the layers above ask of a recipe, in place of
``is_fp4`` branches outside ``fp8/`` and ``kernels/``. Checked against what the quantizers really store
and against the NVFP4 recipes, the only ones without the capabilities today."""

from __future__ import annotations

import pytest
import torch

from infir2.fp8 import RECIPES, quantize
from infir2.fp8.nvfp4 import quantize_nvfp4

NVFP4 = {"nvfp4", "nvfp4_4over6"}
FP8 = sorted(name for name, r in RECIPES.items() if r.enabled and name not in NVFP4)


def test_nvfp4_recipes_are_the_only_ones_without_the_capabilities():
    assert {name for name in RECIPES if name not in NVFP4 and RECIPES[name].enabled} == set(FP8)
    for name in FP8:
        r = RECIPES[name]
        assert r.compiles and r.runs_experts and r.has_telemetry, name
        assert r.k_major_dgrad_weight == r.reuses_weight, name  # an FP8 weight shared by fprop and dgrad
    for name in NVFP4:
        r = RECIPES[name]
        assert not (r.compiles or r.runs_experts or r.has_telemetry or r.k_major_dgrad_weight), name
        assert r.reuses_weight  # one 16x16 weight serves both GEMMs, yet no K-major copy is read


@pytest.mark.parametrize("name", FP8)
def test_fp8_cast_bytes_are_what_the_quantizer_stores(name):
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    for operand, cast in RECIPES[name].casts.items():
        data, scale_inv = quantize(x, cast.block, cast.fmt, cast.scale_encoding)
        assert data.element_size() == cast.code_bytes, (name, operand)
        assert scale_inv.element_size() == cast.block_scale_bytes, (name, operand)
        assert cast.tensor_scale_bytes == 0, (name, operand)


@pytest.mark.parametrize("name", sorted(NVFP4))
def test_nvfp4_cast_bytes_are_what_the_quantizer_stores(name):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    for operand, cast in RECIPES[name].casts.items():
        codes, block_scale_inv, tensor_scale_inv = quantize_nvfp4(
            x, cast.block, cast.rounding, torch.Generator().manual_seed(1), four_over_six=cast.four_over_six
        )
        assert codes.numel() * cast.code_bytes == x.numel() / 2, (name, operand)  # two E2M1 codes a byte
        assert block_scale_inv.element_size() == cast.block_scale_bytes, (name, operand)
        assert tensor_scale_inv.numel() * tensor_scale_inv.element_size() == cast.tensor_scale_bytes
