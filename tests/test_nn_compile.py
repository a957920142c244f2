"""``torch.compile`` of a converted model: one graph forward, one backward, and the eager numerics bit for bit.

Every ``Fp8Linear`` is one ``infir2::fp8_linear`` custom op in the forward graph and one
``infir2::fp8_linear_backward`` in the backward graph (``infir2.nn.custom_ops``); the C kernel and
the caches run inside them. ``fullgraph=True`` turns any graph break into an error, and dynamo's
graph-break counter must stay empty. The backend is AOTAutograd with pass-through compilers
(``aot_eager``, counting the graphs it gets), so compiled and eager run the same kernels: on a CPU losses and gradients are
equal bit for bit wherever the unconverted model's are (``plain_compile_is_exact``). transformers 5.17 (the
oldest version infir2 admits) traces its models' backward in another order: there the plain model's
compiled gradients differ from eager ones by rounding, so only the loss is held to the bit. The same test
runs on CUDA where there is one, bounded there by the unconverted model's own compiled-vs-eager difference.
"""

from __future__ import annotations

import copy
import functools
from contextlib import ExitStack

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from conftest import make_tiny_model
from infir2 import convert_to_fp8
from infir2.nn import cache_fp8_weights

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


def _counting_backend() -> tuple[object, dict[str, list[torch.fx.GraphModule]]]:
    graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}

    def keep(kind: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
            graphs[kind].append(gm)
            return torch._functorch.aot_autograd.make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")), graphs


def _ops(gm: torch.fx.GraphModule, name: str) -> int:
    return sum(
        1 for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith(f"infir2.{name}.")
    )


def _step(
    model: torch.nn.Module, ids: torch.Tensor, trainer: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    with ExitStack() as stack:
        if trainer:  # as the training loop runs it: the weight cache, bf16 autocast
            stack.enter_context(cache_fp8_weights(model))
        with torch.autocast(ids.device.type, torch.bfloat16, enabled=trainer):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _compiled_vs_eager(model: torch.nn.Module, ids_list: list[torch.Tensor], trainer: bool):
    """(largest |compiled - eager| of the losses, of the gradients, the graphs, the graph-break counter)."""
    torch._dynamo.reset()
    counters.clear()
    backend, graphs = _counting_backend()
    compiled = torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True)
    worst_loss = worst_grad = 0.0
    for ids in ids_list:
        eager_loss, eager_grads = _step(model, ids, trainer)
        loss, grads = _step(compiled, ids, trainer)
        worst_loss = max(worst_loss, (eager_loss.float() - loss.float()).abs().item())
        for a, b in zip(eager_grads, grads, strict=True):
            worst_grad = max(worst_grad, (a.float() - b.float()).abs().max().item())
    return worst_loss, worst_grad, graphs, dict(counters["graph_break"])


@functools.cache
def plain_compile_is_exact(trainer: bool) -> bool:
    """Whether the unconverted tiny model's compiled gradients equal its eager ones on this CPU and
    transformers (the frame in which an FP8 model's can be held to the bit)."""
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 300, (2, 64), generator=gen)]
    worst_loss, worst_grad, _, breaks = _compiled_vs_eager(make_tiny_model(), ids, trainer)
    assert breaks == {} and worst_loss == 0.0
    return worst_grad == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("recipe", "trainer"), [("blockwise", True), ("mxfp8", False)])
def test_compiled_fp8_model_has_no_graph_break_and_eager_numerics(device, recipe, trainer):
    """blockwise under bf16 autocast and the weight cache (how the trainer runs it), mxfp8 in fp32 (its
    weight is quantized again for dgrad); two sequence lengths, the second traced with dynamic shapes."""
    gen = torch.Generator().manual_seed(0)
    ids_list = [torch.randint(0, 300, (2, t), generator=gen).to(device) for t in (64, 40)]
    model = convert_to_fp8(make_tiny_model().to(device), recipe)
    worst_loss, worst_grad, graphs, breaks = _compiled_vs_eager(model, ids_list, trainer)
    assert breaks == {}
    assert 1 <= len(graphs["forward"]) <= len(ids_list)  # one graph per shape at most (a recompile)
    assert len(graphs["backward"]) == len(graphs["forward"])
    assert all(_ops(gm, "fp8_linear") == 14 for gm in graphs["forward"])  # 2 layers x 7 projections
    assert all(_ops(gm, "fp8_linear_backward") == 14 for gm in graphs["backward"])
    if device == "cpu":
        assert worst_loss == 0.0  # the same kernels compiled and eager: the same bits
        if plain_compile_is_exact(trainer):  # else the model around the FP8 ops reorders its backward
            assert worst_grad == 0.0
    else:  # cuBLAS / Triton may pick other algorithms inside a graph: no larger than the unconverted model's
        ref_loss, ref_grad, _, ref_breaks = _compiled_vs_eager(
            make_tiny_model().to(device), ids_list, trainer
        )
        assert ref_breaks == {}
        assert max(worst_loss, worst_grad) <= max(ref_loss, ref_grad, 1e-6)


def test_cuda_graph_capture_is_refused(monkeypatch):
    """Under CUDA graph capture (``mode="reduce-overhead"``) the eager layer and both custom ops raise:
    their caches are outside the graph, so a replay would train on the captured step's FP8 weight.
    The capture is faked here (no GPU): CUDA initialized and the current stream capturing."""
    from infir2.nn import Fp8Linear

    layer = Fp8Linear(256, 128, bias=False)
    x = torch.randn(4, 256, requires_grad=True)
    y, x_data, x_scale_inv, w_data, w_scale_inv = torch.ops.infir2.fp8_linear(
        x, layer.weight, None, layer.op_key, None
    )
    backward_args = (torch.ones_like(y), x_data, x_scale_inv, w_data, w_scale_inv, layer.weight.detach())
    backward_args += (layer.op_key, x.dtype, x.dtype, [True, True, False])
    torch.ops.infir2.fp8_linear_backward(*backward_args)  # runs outside a capture
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"CUDA graph capture.*stale FP8 weights"):
        layer(x)
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        torch.ops.infir2.fp8_linear(x, layer.weight, None, layer.op_key, None)
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        torch.ops.infir2.fp8_linear_backward(*backward_args)
    layer.fp8_enabled = False  # a plain linear has no cache: it may be captured
    assert layer(x).shape == (4, 128)
