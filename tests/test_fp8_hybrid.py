"""``blockwise_hybrid``: the blockwise tiles with E5M2 for the output gradient (TransformerEngine's HYBRID).

Checked against the plain-torch quantizer (``infir2.fp8.quantize``, the reference every kernel is held
to), fp64 GEMMs, and the blockwise recipe itself: the forward must be blockwise's bit for bit (E4M3 X
and W in both), only the two GEMMs that read dY change.
"""

from __future__ import annotations

import pytest
import torch

from infir2 import Fp8Linear, sqnr
from infir2.fp8 import dequantize, get_format, get_recipe, quantize
from test_nn_fp8linear import fp64_reference, run_fp8


def _q(a: torch.Tensor, block: tuple[int, int], fmt: str = "e4m3") -> torch.Tensor:
    return dequantize(*quantize(a, block, fmt, "pow2"), block)


def test_the_recipe_is_blockwise_with_e5m2_output_gradients() -> None:
    hybrid, blockwise = get_recipe("blockwise_hybrid"), get_recipe("blockwise")
    for name, cast in hybrid.casts.items():
        ref = blockwise.casts[name]
        assert cast.block == ref.block and cast.scale_encoding == ref.scale_encoding == "pow2", name
        assert cast.fmt == ("e5m2" if name in ("dy", "dy_wgrad") else "e4m3"), name
    assert hybrid.gathers_fp8_weight and hybrid.param_gather_default  # E4M3 weights gather as FP8 codes


@pytest.mark.parametrize("backend", [None, "emulated"])  # the CPU default (fast_emulated) and the reference
@pytest.mark.parametrize(("t", "k", "n"), [(130, 256, 384), (64, 200, 136)])
def test_hybrid_linear_is_its_three_gemms_on_dequantized_operands(backend, t, k, n) -> None:
    torch.manual_seed(2)
    layer = Fp8Linear(k, n, bias=False, recipe="blockwise_hybrid", backend=backend)
    twin = Fp8Linear(k, n, bias=False, recipe="blockwise", backend=backend)
    twin.weight.data.copy_(layer.weight.data)
    x, g = torch.randn(t, k), torch.randn(t, n) * 1e-3  # gradient-sized dY
    y, dx, dw = run_fp8(layer, x, g)
    y_b, dx_b, _ = run_fp8(twin, x, g)
    assert torch.equal(y, y_b)  # the forward is blockwise's
    assert not torch.equal(dx, dx_b)  # and dgrad is not: E5M2 dY
    w = layer.weight.detach()
    # [T,N] @ [N,K] -> [T,K] and [N,T] @ [T,K] -> [N,K], fp32 accumulate, on the dequantized operands
    torch.testing.assert_close(dx, _q(g, (1, 128), "e5m2") @ _q(w, (128, 128)), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(dw, _q(g, (128, 1), "e5m2").t() @ _q(x, (128, 1)), rtol=1e-5, atol=1e-7)


def test_hybrid_linear_sqnr_vs_fp64() -> None:
    """E5M2 keeps one mantissa bit fewer than E4M3, ~6 dB of SQNR: the gradients land near 24.6 dB
    where blockwise's are near 28.5 (its forward stays at blockwise's)."""
    torch.manual_seed(0)
    layer = Fp8Linear(200, 300, bias=True, recipe="blockwise_hybrid")
    x, grad = torch.randn(2, 50, 200), torch.randn(2, 50, 300)
    y, dx, dw = run_fp8(layer, x, grad)
    y_ref, dx_ref, dw_ref = fp64_reference(x, layer.weight, layer.bias, grad)
    assert sqnr(y_ref, y) >= 25
    assert 21 <= sqnr(dx_ref, dx) < 27 and 21 <= sqnr(dw_ref, dw) < 27


def test_e5m2_keeps_gradients_that_e4m3_blocks_flush() -> None:
    """What the hybrid format buys: inside one 1x128 tile whose amax sits 2**20 above most values,
    E4M3 (smallest subnormal 2**-9 of its max 448) flushes the small ones to zero; E5M2 (2**-16 of
    57344) keeps them."""
    row = torch.full((1, 128), 2.0**-14)
    row[0, 0] = 2.0**6
    e4m3, e5m2 = _q(row, (1, 128), "e4m3"), _q(row, (1, 128), "e5m2")
    assert torch.count_nonzero(e4m3) == 1 and torch.equal(e5m2, row)
    assert get_format("e5m2").max > get_format("e4m3").max


def test_a_hybrid_model_exports_the_bytes_a_blockwise_one_does(tmp_path, tiny_tokenizer) -> None:
    """The weights are E4M3 in 128x128 blocks either way: the FP8 export does not depend on dY's format."""
    from safetensors.torch import load_file

    from conftest import make_tiny_model
    from infir2 import convert_to_fp8
    from infir2.export import export_model

    folders = {}
    for recipe in ("blockwise", "blockwise_hybrid"):
        model = convert_to_fp8(make_tiny_model(seed=4), recipe)
        folders[recipe] = export_model(model, tiny_tokenizer, tmp_path / recipe, fmt="fp8")
    shards = {r: sorted(f.glob("*.safetensors")) for r, f in folders.items()}
    assert len(shards["blockwise"]) == len(shards["blockwise_hybrid"]) >= 1
    for a, b in zip(shards["blockwise"], shards["blockwise_hybrid"], strict=True):
        ta, tb = load_file(a), load_file(b)
        assert ta.keys() == tb.keys() and any(t.dtype == torch.float8_e4m3fn for t in ta.values())
        assert all(torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)) for k in ta)
