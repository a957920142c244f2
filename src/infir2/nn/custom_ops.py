"""``Fp8Linear`` under ``torch.compile``: the layer's forward and backward as two ``torch.library`` custom ops.

Eager ``Fp8Linear`` runs ``_Fp8LinearFunction``, whose kernels dynamo cannot trace: the CPU
emulation's C kernel is a ``ctypes`` call, and the weight cache and the input cache (one FP8 copy of
the q/k/v input for three layers) are Python state keyed by tensor identity and version. Traced
naively, every FP8 layer splits the model's graph. So under ``torch.compile`` the layer calls

    infir2::fp8_linear(x [..., K], weight [N, K], bias [N]?, layer, dtype?)
        -> y [..., N], x_wgrad data [T, K] fp8, its scale_inv, w_dgrad data [N, K] fp8, its scale_inv
    infir2::fp8_linear_backward(dy [..., N], <the saved tensors>, weight, layer, dtype, x dtype, needs)
        -> dX [..., K], dW [N, K], db [N]

(``torch.library.custom_op`` with ``register_fake`` for shapes and ``register_autograd`` tying
them together, as torchao does for its float8 ops). Both run the eager ``_Fp8LinearFunction``'s own
``forward`` / ``backward`` inside, so compiled numerics are the eager numerics bit for bit, and the
caches, the kernel binding and the C kernel stay outside the traced graph. ``layer`` is the
``Fp8Linear``'s registry key (a custom op takes tensors and plain values only); ``dtype`` is the
autocast dtype the input is cast to inside the op, so that the input cache still sees the one tensor
that q, k and v share. The FP8 copies backward needs are outputs of the forward op, so the compiled
graph saves them; a weight that the weight cache holds dequantized (the CPU emulation) is found there
again by backward rather than decoded twice. CUDA graphs (``mode="reduce-overhead"``) are refused
with an error: the caches the ops read and write are not declared to the graph, so a replay would
reuse the FP8 weight of the captured step (``refuse_graph_capture``). What a compiled step does not record: the backward half
of FP8 telemetry (``infir2.nn.telemetry``; the forward half is recorded).
"""

from __future__ import annotations

from typing import Any

import torch

from ..fp8.formats import get_format
from ..fp8.quantize import Block
from ..fp8.recipe import Cast
from ..kernels import Operand
from .linear import _INPUT_CACHE, Fp8Linear, _Fp8LinearFunction, refuse_graph_capture
from .module import module_by_key

__all__ = ["fp8_linear", "fp8_linear_backward"]

_EMPTY = (0,)


class _Context:
    """Stands in for the autograd ctx of ``_Fp8LinearFunction`` when it runs inside a custom op."""

    def __init__(self, needs_input_grad: tuple[bool, ...] = ()) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple[torch.Tensor, ...] = ()
        self.w_kept: Operand | None = None  # the attributes _Fp8LinearFunction sets and reads
        self.w_transposed = False  # the K-major dgrad weight (CUDA eager only) is not used here
        self.k_major_in_backward = False
        self.recipe: Any = None
        self.kernels: Any = None
        self.x_dtype: torch.dtype | None = None
        self.has_bias = False
        self.probe: Any = None
        self.n_x_saved = (
            2  # x_wgrad as FP8 codes and scales (an NVFP4 layer never compiles: Fp8Linear.forward)
        )
        self.x_restore = Operand.restore
        self.w_restore = Operand.restore

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors


def _scale_dtype(cast: Cast) -> torch.dtype:
    return torch.float8_e8m0fnu if cast.scale_encoding == "e8m0" else torch.float32


def _blocks(rows: Any, cols: Any, block: Block) -> tuple[Any, Any]:
    """``[ceil(rows/bm), ceil(cols/bk)]`` (``-1``: one block along that dimension); works on SymInts."""
    bm, bk = block
    return (1 if bm == -1 else -(-rows // bm)), (1 if bk == -1 else -(-cols // bk))


def _empty(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return like.new_empty(_EMPTY, dtype=dtype)


@torch.library.custom_op("infir2::fp8_linear", mutates_args=())
def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    refuse_graph_capture()  # the caches are not declared to the graph: see refuse_graph_capture
    module = module_by_key(layer, Fp8Linear)
    original = x
    if dtype is not None:
        x = x.to(dtype)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, module.in_features)  # [..., K] -> [T, K]
    kernels = module._kernels_on(x.device)
    w_fprop = module.quantized_weight(kernels)
    x_ops = _INPUT_CACHE.get(original, x2d, module.recipe, kernels)
    ctx = _Context()
    with torch.no_grad():
        y = _Fp8LinearFunction.forward(
            ctx, x2d, weight, bias, module.recipe, kernels, w_fprop, x_ops, module.recorder("weight")
        )
    x_data, x_scale_inv, _weight, *w_saved = ctx.saved_tensors
    if ctx.w_kept is not None:
        w_saved = [ctx.w_kept.data, ctx.w_kept.scale_inv]
    if not w_saved:  # the recipe quantizes W again for dgrad (another block shape)
        w_saved = [_empty(x, torch.uint8), _empty(x, torch.float32)]
    # the FP8 copies may be the caches' tensors (q, k and v share one x_wgrad): they alias no input
    return y.reshape(*lead, module.out_features), x_data, x_scale_inv, w_saved[0], w_saved[1]


@fp8_linear.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    recipe = module_by_key(layer, Fp8Linear).recipe
    n, k = weight.shape
    tokens = x.numel() // k
    x_cast = recipe.x_wgrad
    y = x.new_empty((*x.shape[:-1], n), dtype=dtype or x.dtype)
    x_data = x.new_empty((tokens, k), dtype=get_format(x_cast.fmt).dtype)
    x_scale_inv = x.new_empty(_blocks(tokens, k, x_cast.block), dtype=_scale_dtype(x_cast))
    if recipe.reuses_weight:
        w_data = x.new_empty((n, k), dtype=get_format(recipe.w.fmt).dtype)
        w_scale_inv = x.new_empty(_blocks(n, k, recipe.w.block), dtype=_scale_dtype(recipe.w))
    else:
        w_data, w_scale_inv = _empty(x, torch.uint8), _empty(x, torch.float32)
    return y, x_data, x_scale_inv, w_data, w_scale_inv


@torch.library.custom_op("infir2::fp8_linear_backward", mutates_args=())
def fp8_linear_backward(
    dy: torch.Tensor,
    x_data: torch.Tensor,
    x_scale_inv: torch.Tensor,
    w_data: torch.Tensor,
    w_scale_inv: torch.Tensor,
    weight: torch.Tensor,
    layer: int,
    x_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    refuse_graph_capture()
    module = module_by_key(layer, Fp8Linear)
    recipe, kernels = module.recipe, module._kernels_on(dy.device)
    ctx = _Context(tuple(needs))
    ctx.recipe, ctx.kernels, ctx.x_dtype, ctx.has_bias = recipe, kernels, compute_dtype, needs[2]
    # a weight operand kept whole (the CPU emulation's decoded copy) that the weight cache still holds is
    # the one forward used: backward takes it as eager backward does, with no second decode
    cached = module.cached_weight()
    if cached is not None and cached.keep_for_backward and cached.data is w_data:
        ctx.w_kept = cached
    w_saved = (w_data, w_scale_inv) if w_data.numel() and ctx.w_kept is None else ()
    ctx.saved_tensors = (x_data, x_scale_inv, weight, *w_saved)
    lead = dy.shape[:-1]
    with torch.no_grad():
        dx, dw, db, *_ = _Fp8LinearFunction.backward(ctx, dy.reshape(-1, module.out_features))
    # the op returns tensors only: an empty one where autograd needs no gradient
    dx = dy.new_empty(_EMPTY, dtype=x_dtype) if dx is None else dx.reshape(*lead, -1).to(x_dtype)
    dw = weight.new_empty(_EMPTY) if dw is None else dw
    db = weight.new_empty(_EMPTY) if db is None else db
    return dx, dw, db


@fp8_linear_backward.register_fake
def _(dy: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's arguments after ``dy`` (positional, as the dispatcher passes them): only shapes are read."""
    _x_data, _x_scale_inv, _w_data, _w_scale_inv, weight, _layer, x_dtype, _compute_dtype, needs = args
    n, k = weight.shape
    dx = dy.new_empty((*dy.shape[:-1], k) if needs[0] else _EMPTY, dtype=x_dtype)
    dw = weight.new_empty((n, k) if needs[1] else _EMPTY)
    db = weight.new_empty((n,) if needs[2] else _EMPTY)
    return dx, dw, db


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, weight, bias, layer, dtype = inputs
    _y, x_data, x_scale_inv, w_data, w_scale_inv = output
    ctx.save_for_backward(x_data, x_scale_inv, w_data, w_scale_inv, weight)
    ctx.layer, ctx.x_dtype, ctx.compute_dtype = layer, x.dtype, dtype or x.dtype
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(x_data, x_scale_inv, w_data, w_scale_inv)


def _backward(ctx: Any, dy: torch.Tensor, *_unused: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x_data, x_scale_inv, w_data, w_scale_inv, weight = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
    dx, dw, db = fp8_linear_backward(
        dy, x_data, x_scale_inv, w_data, w_scale_inv, weight, ctx.layer, ctx.x_dtype, ctx.compute_dtype, needs
    )
    return (dx if needs[0] else None, dw if needs[1] else None, db if needs[2] else None, None, None)


fp8_linear.register_autograd(_backward, setup_context=_setup_context)
