"""The ``compiled`` backend (``torch.compile`` of the reference quantizer/dequantizer) is bit-exact.

Inductor may reorder or fuse the element-wise math; these tests pin that it does not change a bit:
scales, FP8 data (NaN positions as NaN), and a whole ``Fp8Linear`` step equal to the emulated backend.
Slow: the first compilation in a process takes ~30 s on the development CPU.
"""

from __future__ import annotations

import pytest
import torch

from infir2.fp8 import quantize
from infir2.fp8.recipe import Cast
from infir2.kernels import compiled
from infir2.nn import Fp8Linear

pytestmark = pytest.mark.slow


def _hard_input(shape: tuple[int, int]) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 3
    x[0, 0], x[1, 3], x[-1, -1] = float("nan"), float("inf"), float("-inf")
    x[2] = 0.0
    x[:, 5] *= 1e4
    x[-2, :40] = 1e-30
    return x


def test_compiled_quantize_is_bit_exact():
    # Whole blocks are compiled; partial edge blocks run eager: a first, static-shape compile of the
    # reference on [260, 300] with (1, 128) blocks wrote wrong FP8 data in the partial block (torch 2.13 CPU).
    for shape in [(256, 384), (260, 300)]:
        x = _hard_input(shape)
        for block, encoding in [((1, 128), "pow2"), ((128, 1), "fp32"), ((128, 128), "pow2")]:
            op = compiled.quantize(x, Cast(block, scale_encoding=encoding))
            data, scale_inv = quantize(x, block, "e4m3", encoding)
            assert torch.equal(op.scale_inv, scale_inv), (shape, block)
            nan = op.data.float().isnan() & data.float().isnan()
            assert bool(((op.data.view(torch.uint8) == data.view(torch.uint8)) | nan).all()), (shape, block)


def test_compiled_backend_step_equals_emulated():
    torch.manual_seed(0)
    layers = {name: Fp8Linear(256, 384, backend=name) for name in ("emulated", "compiled")}
    layers["compiled"].load_state_dict(layers["emulated"].state_dict())
    x = torch.randn(2, 64, 256)
    grads = {}
    for name, layer in layers.items():
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.square().sum().backward()
        grads[name] = (y.detach(), xi.grad, layer.weight.grad, layer.bias.grad)
    for a, b in zip(grads["emulated"], grads["compiled"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
