"""Mixture-of-experts in FP8: the grouped GEMM against the dense FP8 linear, and the conversion of v5 MoE models.

The grouped GEMM is checked three ways: bit for bit against a loop over experts of infir2's dense
``Fp8Linear`` (forward, dgrad, wgrad; uneven groups and an empty expert), against float64 GEMMs of
the same quantized operands (the dense test's tolerance), and by SQNR against the bf16 grouped GEMM
(torchao's floors: 27 dB output, 26 dB gradients). The conversion is checked per family on tiny
``from_config`` models: every routed and shared expert GEMM in FP8, routers and ``lm_head`` not,
nothing left out without a logged reason, state-dict keys unchanged.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from infir2 import Fp8Linear, convert_to_fp8, sqnr
from infir2.fp8 import dequantize, get_recipe, quantize
from infir2.kernels import bind
from infir2.nn import disable_fp8
from infir2.nn.moe import Fp8Experts, fp8_grouped_linear
from moe_models import FAMILIES, make_tiny_moe

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

COUNTS = [129, 0, 384, 500]  # uneven, one expert without tokens, one group over several 128-token tiles


def _grouped(x, weight, counts, recipe="blockwise", backend=None):
    recipe = get_recipe(recipe)
    kernels = bind(recipe, x.device, backend)
    x = x.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    y = fp8_grouped_linear(x, w, counts, recipe, kernels)
    return x, w, y


def _dense_loop(x, weight, dy, counts, backend=None):
    """Each expert as its own Fp8Linear over its rows: (y, dx, dw)."""
    ys, dxs, dws, start = [], [], [], 0
    for e, count in enumerate(counts):
        layer = Fp8Linear(weight.shape[2], weight.shape[1], bias=False, backend=backend)
        layer.weight = nn.Parameter(weight[e].clone())
        rows = x[start : start + count].clone().requires_grad_()
        if count:
            y = layer(rows)
            y.backward(dy[start : start + count])
            ys.append(y.detach())
            dxs.append(rows.grad)
            dws.append(layer.weight.grad)
        else:
            dws.append(torch.zeros_like(layer.weight))
        start += count
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


@pytest.mark.parametrize("backend", [None, "emulated"])
@pytest.mark.parametrize(("k", "n"), [(256, 384), (128, 192)])
def test_grouped_gemm_is_the_dense_fp8_linear_per_expert_bit_for_bit(backend, k, n):
    torch.manual_seed(0)
    s = sum(COUNTS)
    x0, w0, dy = torch.randn(s, k), torch.randn(len(COUNTS), n, k) * 0.05, torch.randn(s, n)
    x, w, y = _grouped(x0, w0, COUNTS, backend=backend)
    y.backward(dy)
    y_ref, dx_ref, dw_ref = _dense_loop(x0, w0, dy, COUNTS, backend)
    assert torch.equal(y.detach(), y_ref)
    assert torch.equal(x.grad, dx_ref)
    assert torch.equal(w.grad, dw_ref)
    assert not w.grad[1].any()  # the expert without tokens has no gradient


def test_grouped_gemm_meets_fp64_reference_of_the_same_quantized_operands():
    """Per expert: fprop Q(X,1x128) @ Q(W,128x128).T, dgrad Q(dY,1x128) @ Q(W), wgrad Q(dY,128x1).T @ Q(X,128x1)."""
    torch.manual_seed(1)
    s, k, n = sum(COUNTS), 256, 384
    x0, w0, dy = torch.randn(s, k), torch.randn(len(COUNTS), n, k) * 0.05, torch.randn(s, n)
    x, w, y = _grouped(x0, w0, COUNTS)
    y.backward(dy)

    def q(a, block):
        return dequantize(*quantize(a, block), block, dtype=torch.float64)

    start = 0
    for e, count in enumerate(COUNTS):
        rows = slice(start, start + count)
        xe, ge, we = x0[rows], dy[rows], w0[e]
        if count:
            assert torch.allclose(
                y[rows].double(), q(xe, (1, 128)) @ q(we, (128, 128)).t(), rtol=1e-5, atol=1e-5
            )
            assert torch.allclose(
                x.grad[rows].double(), q(ge, (1, 128)) @ q(we, (128, 128)), rtol=1e-5, atol=1e-5
            )
            wgrad = q(ge, (128, 1)).t() @ q(xe, (128, 1))  # 128-token tiles of this expert's rows only
            assert torch.allclose(w.grad[e].double(), wgrad, rtol=1e-5, atol=1e-4)
        start += count


def _bf16_grouped(x, weight, counts):
    """The bf16 grouped GEMM (``torch.nn.functional.grouped_mm``), with autograd."""
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = x.to(torch.bfloat16).requires_grad_()
    w = weight.to(torch.bfloat16).requires_grad_()
    return x, w, torch.nn.functional.grouped_mm(x, w.transpose(-2, -1), offs=offs)


def test_grouped_gemm_sqnr_against_bf16_grouped_gemm():
    torch.manual_seed(2)
    s, k, n = sum(COUNTS), 256, 384
    x0, w0, dy = torch.randn(s, k), torch.randn(len(COUNTS), n, k) * 0.05, torch.randn(s, n)
    xr, wr, yr = _bf16_grouped(x0, w0, COUNTS)
    yr.backward(dy.to(torch.bfloat16))
    x, w, y = _grouped(x0.to(torch.bfloat16), w0, COUNTS)
    y.backward(dy.to(torch.bfloat16))
    assert sqnr(yr.float(), y.float()) >= 27
    assert sqnr(xr.grad.float(), x.grad.float()) >= 26
    assert sqnr(wr.grad.float(), w.grad.float()) >= 26


def test_grouped_gemm_rejects_counts_that_do_not_cover_the_rows():
    kernels = bind(get_recipe("blockwise"), "cpu")
    with pytest.raises(ValueError, match="counts"):
        fp8_grouped_linear(
            torch.randn(10, 128), torch.randn(2, 128, 128), [4, 5], get_recipe("blockwise"), kernels
        )


# ------------------------------------------------------------------------------------------ conversion


def _convert_logged(model, caplog, **kwargs):
    with caplog.at_level(logging.INFO, logger="infir2.nn.convert"):
        convert_to_fp8(model, **kwargs)
    return " ".join(r.getMessage() for r in caplog.records if r.name == "infir2.nn.convert")


@pytest.mark.parametrize("family", FAMILIES)
def test_conversion_covers_routed_and_shared_experts(family, caplog):
    model = make_tiny_moe(family)
    keys = list(model.state_dict())
    message = _convert_logged(model, caplog)
    assert list(model.state_dict()) == keys  # HF checkpoints load and save unchanged
    layers = model.model.layers
    for layer in layers:
        mlp = layer.mlp
        assert isinstance(mlp.experts, Fp8Experts), f"{family}: routed experts left in high precision"
        assert type(mlp.gate) is not Fp8Linear and not any(
            isinstance(m, Fp8Linear) for m in mlp.gate.modules()
        )
        for shared in ("shared_expert", "shared_experts"):
            if hasattr(mlp, shared):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    assert isinstance(getattr(getattr(mlp, shared), proj), Fp8Linear)
    assert type(model.lm_head) is nn.Linear
    assert type(model.get_input_embeddings()) is nn.Embedding
    # nothing skipped silently: every other linear of the decoder is FP8 or named in the summary
    for fqn, m in model.named_modules():
        if type(m) is nn.Linear and fqn.startswith("model.layers."):
            assert fqn in message, f"{fqn} stayed high precision without a reason in the log"
        assert not any(p.dim() == 3 for p in m.parameters(recurse=False)) or isinstance(m, Fp8Experts)
    assert f"2 routed-expert groups ({2 * 2 * 4} expert GEMMs" in message
    assert "(MoE router)" in message and "lm_head (output head)" in message


def test_module_filter_fn_can_exclude_the_experts(caplog):
    model = make_tiny_moe("qwen3_moe")
    message = _convert_logged(model, caplog, module_filter_fn=lambda m, fqn: not fqn.endswith("experts"))
    assert not any(isinstance(m, Fp8Experts) for m in model.modules())
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert "model.layers.0.mlp.experts" in message and "excluded by module_filter_fn" in message


def test_unrecognised_experts_warn(caplog):
    model = make_tiny_moe("mixtral")
    model.model.layers[1].mlp.experts.has_bias = True  # a layout Fp8Experts does not run (GPT-OSS style)
    with caplog.at_level(logging.INFO, logger="infir2.nn.convert"):
        convert_to_fp8(model)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("MoE experts not recognised" in w and "model.layers.1.mlp.experts" in w for w in warnings)
    assert isinstance(model.model.layers[0].mlp.experts, Fp8Experts)
    assert not isinstance(model.model.layers[1].mlp.experts, Fp8Experts)


def test_a_router_without_known_experts_warns(caplog):
    model = make_tiny_moe("qwen3_moe")
    model.model.layers[1].mlp.experts = nn.Identity()  # experts of a kind convert_to_fp8 does not know
    with caplog.at_level(logging.INFO, logger="infir2.nn.convert"):
        convert_to_fp8(model)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("has a router but no experts module" in w and "model.layers.1.mlp" in w for w in warnings)


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_casts_reproduce_the_high_precision_experts(family):
    """With ``fp8_exact`` (every element its own block) only fp32 rounding separates the FP8 experts from
    transformers' own experts implementation: routing, gathering, gating and combining are the same."""
    model = make_tiny_moe(family)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    ref = model(ids).logits
    convert_to_fp8(model, "fp8_exact")
    out = model(ids).logits
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4)
    with disable_fp8(model):
        assert torch.equal(model(ids).logits, ref)  # FP8 off: the original implementation


def test_fp8_experts_gradients_reach_every_routed_expert_and_the_router():
    model = make_tiny_moe("qwen3_moe")
    convert_to_fp8(model)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.grad is not None and experts.down_proj.grad is not None
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # routing stays differentiable


def test_converted_moe_model_pickles_and_copies():
    """``torch.save(model)`` / spawn (pickle) and ``deepcopy`` keep the FP8 experts, each with its own key."""
    import copy
    import pickle

    model = make_tiny_moe("mixtral")
    convert_to_fp8(model)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    expected = model(ids).logits
    for other in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        experts = other.model.layers[0].mlp.experts
        assert isinstance(experts, Fp8Experts) and experts.op_key != model.model.layers[0].mlp.experts.op_key
        assert torch.equal(other(ids).logits, expected)


def test_telemetry_records_every_expert_operand():
    """``fp8.stats_every``: per expert weight, the six operands and three SQNRs, over all its experts."""
    from infir2.nn.telemetry import OPERAND_STATS, Fp8Telemetry

    model = make_tiny_moe("qwen3_moe")
    convert_to_fp8(model)
    telemetry = Fp8Telemetry(model, every=1)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(4))
    with telemetry.record(1) as out:
        model(input_ids=ids, labels=ids).loss.backward()
    name = "fp8/model.layers.0.mlp.experts.gate_up_proj"
    operands = ("fprop.x", "fprop.w", "dgrad.dy", "dgrad.w", "wgrad.dy", "wgrad.x")
    for operand in operands:
        for stat in OPERAND_STATS:
            assert f"{name}/{operand}/{stat}" in out, f"{operand}/{stat}"
    weight = model.model.layers[0].mlp.experts.gate_up_proj
    assert out[f"{name}/fprop.w/amax"] == weight.detach().abs().max().item()  # all experts together
    for result in ("fprop.y", "dgrad.dx", "wgrad.dw"):
        assert out[f"{name}/{result}/sqnr_db"] > 25, result
    assert model.model.layers[0].mlp.experts.stats is None  # detached after the step
