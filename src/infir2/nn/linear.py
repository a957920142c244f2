"""``Fp8Linear``: an ``nn.Linear`` whose three GEMMs run in FP8 with hybrid-granularity scales.

For ``Y = X @ W.T + b`` with X ``[T, K]`` (tokens x in_features) and W ``[N, K]``::

    fprop  Y  = Q(X, 1x128)  @ Q(W, 128x128).T     [T,K] @ [K,N] -> [T,N]
    dgrad  dX = Q(dY, 1x128) @ Q(W, 128x128)       [T,N] @ [N,K] -> [T,K]
    wgrad  dW = Q(dY, 128x1).T @ Q(X, 128x1)       [N,T] @ [T,K] -> [N,K]

(blocks of the ``blockwise`` recipe; other recipes name other blocks, see ``infir2.fp8.recipe``).
Each operand is quantized from its high-precision original, never re-quantized from another FP8
copy, so each GEMM gets the tiling that runs along its own reduction dimension. Products
accumulate in fp32; Y and dX come back in the input's dtype, dW in the weight's dtype (the fp32
master weight). Why these tiles: activations have per-token outliers, so a scale per token per 128
channels keeps one outlier from flushing its neighbours to zero; weights are smooth, and one scale
per 128x128 block lets the same quantized weight serve fprop and dgrad (its transpose is still
128x128 blocks).

Memory: the only activation saved for backward is the FP8 wgrad copy of X (``Q(X, 128x1)``, one
byte per element plus scales), not X itself, which is what makes FP8 save memory at all.

The dgrad B operand is ``Q(W).T [K, N]``, whose reduction dimension (N) is the slow one of the
quantized weight; FP8 tensor-core GEMMs want it contiguous (cuBLAS copies it, Triton transposes in
registers, every call). On CUDA inside ``cache_fp8_weights(model, "step")`` the layer therefore keeps
one K-major copy of the transposed FP8 weight per step beside the forward one (as torchao and
DeepSeek-V3 do): one more byte per weight element for the step, no copy per micro-batch. Inside
``cache_fp8_weights(model, "layer")`` (the trainer's default, ``fp8.weight_cache``) and for a weight
all-gathered by FSDP2, backward saves the forward copy and makes the K-major one from it once per
backward, freed after the dgrad GEMM (keeping it from forward would hold every layer's whole FP8
weight at once): the same bytes reach the same GEMM. On a CPU backward uses ``Q(W).T`` as a view.

Token counts: where cuBLAS runs the GEMMs, a micro-batch whose token count is not a multiple of 128
is padded with zero tokens inside the layer (``pad_tokens``), because the block-scaled wgrad reduces
over tokens in whole 128-token blocks. Zero rows change no block's amax, so every scale and every
code of the real tokens is the same; the padded rows are sliced off the output.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..fp8.accumulate import accumulation_dtype, no_autocast
from ..fp8.formats import BLOCK
from ..fp8.recipe import Fp8Recipe
from ..kernels import Kernels, Nvfp4Operand, Operand, scaled_mm
from .fsdp import Fp8GatheredWeight
from .module import Fp8Module, Recorder

__all__ = ["Fp8Linear"]


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        recipe: Fp8Recipe,
        kernels: Kernels,
        w_fprop: Operand,
        x_ops: tuple[Operand, Operand] | None = None,
        stats: Recorder | None = None,
        w_dgrad_t: Operand | None = None,
        k_major_dgrad: bool = False,
    ) -> torch.Tensor:
        with no_autocast(x.device):
            if x_ops is None:
                x_ops = kernels.quantize_pair(x, recipe.x, recipe.x_wgrad)  # [T,K] fprop copy and wgrad copy
            xq, x_wgrad = x_ops
            # Without a bias the GEMM writes the input's dtype directly (no fp32 [T,N] round trip);
            # with one, the bias is added to the fp32 result before the single rounding.
            out_dtype = x.dtype if bias is None else accumulation_dtype(x.dtype)
            y = kernels.gemm_nt(xq, w_fprop, out_dtype)  # [T,K] @ [K,N] -> [T,N], fp32 accumulate
            if bias is not None:
                y = y + bias.to(out_dtype)
            # The only activation kept for backward: X in FP8, tiled along tokens for wgrad (x_wgrad).
        w_dgrad = w_fprop if recipe.reuses_weight else None
        # the backend's operand says whether backward keeps it whole (a CPU emulation's decoded copy) or
        # only its FP8 bytes and scales (Operand.keep_for_backward)
        ctx.w_kept = w_dgrad if w_dgrad is not None and w_dgrad.keep_for_backward else None
        # The K-major transposed copy (module doc) replaces the forward weight as the saved dgrad operand.
        ctx.w_transposed = w_dgrad is not None and w_dgrad_t is not None
        # an FSDP2-gathered weight is freed after forward and gathered again for backward, and a layer
        # outside the step cache keeps only the forward copy: the K-major copy is made there, once per
        # backward (not kept from forward to backward: module doc)
        ctx.k_major_in_backward = (
            (isinstance(weight, Fp8GatheredWeight) or k_major_dgrad)
            and kernels.device.type == "cuda"
            and not ctx.w_transposed
        )
        saved_w = w_dgrad_t if ctx.w_transposed else w_dgrad
        x_saved = x_wgrad.saved()  # codes and scales (and an NVFP4 operand's tensor scale)
        ctx.x_restore, ctx.n_x_saved = type(x_wgrad).restore, len(x_saved)
        ctx.w_restore = type(saved_w).restore if saved_w is not None else Operand.restore
        ctx.save_for_backward(
            *x_saved,
            weight,
            *(saved_w.saved() if saved_w is not None and ctx.w_kept is None else ()),
        )
        ctx.recipe, ctx.kernels, ctx.x_dtype, ctx.has_bias = recipe, kernels, x.dtype, bias is not None
        y = y.to(x.dtype)
        # telemetry (infir2.nn.telemetry) on a stats step only: reads the operands, changes nothing
        ctx.probe = stats.forward(x, weight, bias, x_ops, w_fprop, y) if stats is not None else None
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        recipe: Fp8Recipe = ctx.recipe
        kernels: Kernels = ctx.kernels
        saved = ctx.saved_tensors  # read once: activation checkpointing unpacks each saved tensor once
        x_saved, (weight, *w_saved) = saved[: ctx.n_x_saved], saved[ctx.n_x_saved :]
        dx = dw = db = None
        with no_autocast(dy.device):
            need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            if need_dx and need_dw:  # dY [T,N]: dgrad copy and wgrad copy, one read where fused
                dyq, dy_w = kernels.quantize_pair(dy, recipe.dy, recipe.dy_wgrad)
            elif need_dx:
                dyq = kernels.quantize(dy, recipe.dy)
            elif need_dw:
                dy_w = kernels.quantize(dy, recipe.dy_wgrad)
            if need_dx:
                if ctx.w_kept is not None:
                    w_dgrad = ctx.w_kept
                elif ctx.w_transposed:  # saved as W.T [K, N], N contiguous: view it back as [N, K]
                    bm, bk = recipe.w_dgrad.block
                    w_dgrad = Operand(w_saved[0], w_saved[1], (bk, bm)).t()
                elif w_saved:
                    w_dgrad = ctx.w_restore(tuple(w_saved), recipe.w_dgrad.block, weight.shape[1])
                else:
                    w_dgrad = kernels.quantize(weight, recipe.w_dgrad)
                w_dgrad_t = w_dgrad.t()  # [K, N]
                if ctx.k_major_in_backward and ctx.w_kept is None:
                    w_dgrad_t = k_major(w_dgrad_t)
                dx = kernels.gemm_nt(dyq, w_dgrad_t, ctx.x_dtype)  # [T,N] @ [N,K] -> [T,K], fp32 accumulate
                if ctx.probe is not None:
                    ctx.probe.dgrad(dy, dyq, w_dgrad, weight, dx)
            if need_dw:
                # [T,K] (NVFP4 + RHT: T padded to 16s)
                x_w = ctx.x_restore(x_saved, recipe.x_wgrad.block, weight.shape[1])
                dw = kernels.gemm_nt(
                    dy_w.t(), x_w.t(), accumulation_dtype(weight.dtype)
                )  # [N,T] @ [T,K] -> [N,K], fp32 accumulate
                dw = dw.to(weight.dtype)
                if ctx.probe is not None:
                    ctx.probe.wgrad(dy, dy_w, dw)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy.to(accumulation_dtype(weight.dtype)).sum(0).to(weight.dtype)
        return dx, dw, db, None, None, None, None, None, None, None


def k_major(op: Operand) -> Operand:
    """``op`` (the ``[K, N]`` view ``Q(W).t()``, N the slow dimension) copied so that N is contiguous:
    the dgrad B operand FP8 tensor-core GEMMs want (cuBLAS would copy it per call)."""
    return Operand(op.data.contiguous(), op.scale_inv.contiguous(), op.block)


def pad_tokens(tokens: int, kernels: Kernels) -> int:
    """Zero tokens to append so that ``tokens`` is a multiple of 128 where cuBLAS runs the GEMMs: its
    block-scaled wgrad reduces over tokens and takes only whole 128-token blocks (else the GEMM would
    go to Triton or the emulation). Zero rows change no scale, so the result is the same."""
    if kernels.device.type != "cuda" or kernels.name != scaled_mm.NAME:
        return 0
    return -tokens % BLOCK


def refuse_graph_capture() -> None:
    """Raise inside CUDA graph capture (``torch.compile(mode="reduce-overhead")``, ``torch.cuda.graph``).

    The FP8 weight cache and the input cache are Python state a captured graph does not see: a replay
    would read the FP8 weight of the step it was captured in and train on it with no error. CUDA is
    asked only once it is initialized (no capture can run before), so a CPU run never touches it.
    """
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "Fp8Linear cannot run inside CUDA graph capture (torch.compile mode='reduce-overhead' or "
            "torch.cuda.graph): its FP8 weight and input caches live outside the graph, so a replay "
            "would train on stale FP8 weights; compile with mode='default' or 'max-autotune-no-cudagraphs'"
        )


class _InputCache:
    """The FP8 copies of the last input tensor, so that layers fed the same tensor quantize it once.

    q/k/v projections all read the same normalized hidden states, gate/up the same MLP input: without
    this, each would quantize it again (two passes over memory each) and save its own FP8 wgrad copy
    for backward. An entry is valid only for the very same tensor object (held by weak reference, so
    a freed tensor whose memory is reused never matches) at the same version (no in-place change).
    """

    def __init__(self) -> None:
        self._ref: weakref.ref[torch.Tensor] | None = None
        self._version = -1
        self._ops: dict[tuple[Any, ...], tuple[Operand, Operand]] = {}

    def get(
        self, original: torch.Tensor, x2d: torch.Tensor, recipe: Fp8Recipe, kernels: Kernels
    ) -> tuple[Operand, Operand]:
        """``(fprop, wgrad)`` operands of ``x2d`` (the 2-D, autocast view of ``original``)."""
        if self._ref is None or self._ref() is not original or self._version != original._version:
            self._ref, self._version, self._ops = weakref.ref(original, self._drop), original._version, {}
        key = (recipe.x, recipe.x_wgrad, kernels.name, x2d.dtype, tuple(x2d.shape))
        if key not in self._ops:
            with torch.no_grad(), no_autocast(x2d.device):
                # [T,K] fprop copy and wgrad copy, from one read where the backend fuses them
                self._ops[key] = kernels.quantize_pair(x2d, recipe.x, recipe.x_wgrad)
        return self._ops[key]

    def clear(self) -> None:
        self._ref, self._version, self._ops = None, -1, {}

    def _drop(self, ref: weakref.ref[torch.Tensor]) -> None:
        """The input of the cached copies is freed: drop them (an older input's going changes nothing)."""
        if ref is self._ref:
            self.clear()


_INPUT_CACHE = _InputCache()


class Fp8Linear(nn.Linear, Fp8Module):
    """Drop-in ``nn.Linear`` (same parameters and state_dict keys) computing its GEMMs in FP8.

    ``recipe`` names the scaling (``blockwise`` by default, see ``infir2.fp8.RECIPES``); ``backend``
    forces a GEMM backend (default: the device's fallback chain, see ``infir2.kernels.bind``). The
    layer is bound to its kernels once (``bind_kernels``; ``convert_to_fp8`` does it) and binds again
    only when an input arrives on another device. Set ``fp8_enabled = False`` (or use
    ``infir2.fp8_enabled(model, False)``) to run it as a plain linear. What it shares with every FP8
    module (recipe, kernels, weight cache, registry key, stats) is ``infir2.nn.module.Fp8Module``.

    Inside ``infir2.nn.cache_fp8_weights(model, "step")`` the quantized weight is computed once and
    reused by every forward until the context exits or the weight is modified in place. Its cache
    entry is ``(forward weight, its K-major transpose for dgrad or None)``: see ``quantized_weight`` and
    ``dgrad_weight``. Inside ``cache_fp8_weights(model, "layer")`` each forward quantizes it and only
    autograd keeps it, until this layer's backward (``infir2.nn.module``: the scopes).
    """

    FP8_WEIGHTS = ("weight",)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        recipe: str | Fp8Recipe = "blockwise",
        backend: str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(recipe, backend)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: str | Fp8Recipe = "blockwise", backend: str | None = None
    ) -> Fp8Linear:
        """Wrap ``linear``'s own parameters (no copy: optimizers and tied weights keep working)."""
        with torch.device("meta"):
            new = cls(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                recipe=recipe,
                backend=backend,
            )
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, fp8_enabled={self.fp8_enabled}"

    def describe(self) -> str:
        return f"Fp8Linear({self.in_features}, {self.out_features})"

    def quantized_weight(self, kernels: Kernels | None = None) -> Operand:
        """The fprop-quantized weight, from the cache when it is on and still valid."""
        w = self.weight
        if isinstance(w, Fp8GatheredWeight):  # all-gathered as FP8 codes by FSDP2 (infir2.nn.fsdp)
            return w.operand
        kernels = kernels or self._kernels_on(w.device)
        key = self.weight_key(w, kernels)
        cached = self.cached("weight", key)
        if cached is not None:
            return cached[0]
        with torch.no_grad():
            wq = kernels.quantize(w.detach(), self.recipe.w)
        self.store("weight", key, (wq, None))
        return wq

    def cached_weight(self) -> Operand | None:
        """The forward weight the cache holds now (whatever its key), or None."""
        entry = self._weight_cache.get("weight")
        return entry[1][0] if entry is not None else None

    def reads_k_major(self, w_fprop: Operand, kernels: Kernels) -> bool:
        """Whether dgrad reads ``w_fprop.t()`` as a K-major copy (module doc): on CUDA, for a weight
        fprop and dgrad share, not a CPU emulation's decoded operand, not NVFP4."""
        return (
            kernels.device.type == "cuda"
            and self.recipe.reuses_weight
            and not w_fprop.keep_for_backward  # a CPU emulation's decoded operand, kept whole
            and not isinstance(w_fprop, Nvfp4Operand)  # emulated on every device: no FP4 GEMM wants K-major
        )

    def dgrad_weight(self, w_fprop: Operand, kernels: Kernels) -> Operand | None:
        """``w_fprop.t()`` stored K-major (``[K, N]``, N contiguous), kept with the step's weight cache;
        or None off CUDA, outside ``cache_fp8_weights(model, "step")`` and for an FSDP2-gathered weight
        (module doc)."""
        entry = self._weight_cache.get("weight")
        if entry is None or entry[1][0] is not w_fprop or not self.reads_k_major(w_fprop, kernels):
            return None
        key, (_, transposed) = entry
        if transposed is None:
            with torch.no_grad():
                transposed = k_major(w_fprop.t())  # one copy per step
            self._weight_cache["weight"] = (key, (w_fprop, transposed))
        return transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():  # one custom op: caches and kernels stay outside the graph
            if not self.recipe.compiles:
                raise NotImplementedError("the nvfp4 recipe runs eager only: its custom op is not written")
            device = x.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
            return torch.ops.infir2.fp8_linear(x, self.weight, self.bias, self.op_key, dtype)[0]
        refuse_graph_capture()  # eager: the custom ops check it themselves
        original = x
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)  # [..., K] -> [T, K]
        kernels = self._kernels_on(x.device)
        tokens = x2d.shape[0]
        pad = pad_tokens(tokens, kernels)
        if pad:  # [T, K] -> [T + pad, K], zero rows (sliced off the output below)
            x2d = F.pad(x2d, (0, 0, 0, pad))
        w_fprop = self.quantized_weight(kernels)
        x_ops = _INPUT_CACHE.get(original, x2d, self.recipe, kernels)
        w_dgrad_t = self.dgrad_weight(w_fprop, kernels)
        # the "layer" scope: backward makes the K-major copy the step cache would have kept
        k_major_dgrad = w_dgrad_t is None and self.k_major_dgrad and self.reads_k_major(w_fprop, kernels)
        y = _Fp8LinearFunction.apply(
            x2d,
            self.weight,
            self.bias,
            self.recipe,
            kernels,
            w_fprop,
            x_ops,
            self.recorder("weight"),
            w_dgrad_t,
            k_major_dgrad,
        )
        y = y[:tokens] if pad else y
        return y.reshape(*lead, self.out_features)
