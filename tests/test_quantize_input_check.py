"""The reference quantizer and the fast CPU emulation refuse the same inputs with the same error (one
``fp8.quantize.check_quantize_input``; the two copies had drifted: a non-tensor was a TypeError in one
and a ValueError in the other)."""

from __future__ import annotations

import pytest
import torch

from infir2.fp8 import quantize
from infir2.kernels.fast_emulated import quantize_fp8

BAD = [
    ([[1.0, 2.0]], TypeError, "expected a torch.Tensor, got list"),
    (torch.ones(4), ValueError, "2-D tensor"),
    (torch.ones(2, 2, 2), ValueError, "2-D tensor"),
    (torch.ones(2, 4, dtype=torch.int32), ValueError, "floating-point tensor"),
    (torch.ones(2, 4).to(torch.float8_e4m3fn), ValueError, "floating-point tensor"),
]


@pytest.mark.parametrize(("x", "error", "text"), BAD)
def test_reference_and_fast_emulation_refuse_alike(x, error, text):
    caught = []
    for fn in (quantize, quantize_fp8):
        with pytest.raises(error, match=text) as info:
            fn(x, (1, 128))
        caught.append(str(info.value))
    assert caught[0] == caught[1]
