"""``Fp8Experts``: the routed experts of a transformers v5 MoE block with their GEMMs in blockwise FP8.

transformers v5 stores the routed experts of Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 (and the
other families built on ``use_experts_implementation``) as two 3-D parameters of one module::

    gate_up_proj  [E, 2I, H]    expert e: [gate; up] = X_e @ gate_up_proj[e].T
    down_proj     [E, H, I]     expert e: Y_e = act(gate) * up @ down_proj[e].T

and runs them through an experts implementation (eager loop, batched or grouped MM). ``Fp8Experts``
takes the place of that module (same parameter objects, same names: state-dict keys and HF
checkpoints are unchanged) and runs each projection as a grouped FP8 GEMM, the dense recipe per
expert (docs/RECIPE.md section 4)::

    fprop  Y_e  = Q(X_e, 1x128)  @ Q(W_e, 128x128).T      [S_e,K] @ [K,N] -> [S_e,N]
    dgrad  dX_e = Q(dY_e, 1x128) @ Q(W_e, 128x128)        [S_e,N] @ [N,K] -> [S_e,K]
    wgrad  dW_e = Q(dY_e, 128x1).T @ Q(X_e, 128x1)        [N,S_e] @ [S_e,K] -> [N,K]

X_e are the rows routed to expert e (a token routed to k experts is k rows), sorted by expert; the
128x1 wgrad tiles run along each expert's own rows, so no tile mixes experts. Every expert is
exactly an ``Fp8Linear`` over its rows (same casts, same kernels, bit for bit on a CPU); an expert
that got no token runs no GEMM and gets a zero weight gradient. No row is dropped or padded.
What backward keeps per expert is the FP8 wgrad copy of its rows, as for a dense layer.

Routing stays where transformers does it and in high precision: the router (``mlp.gate``: linear,
softmax / sigmoid, top-k, bias or aux-loss balancing) gives ``top_k_index`` / ``top_k_weights``, and
this module only gathers the rows, runs the experts, weights each row by its routing weight and sums
a token's k rows in fp32. The rows enter the experts in the autocast dtype, as a
dense ``Fp8Linear``'s input does. With FP8 off (``infir2.disable_fp8``) the original experts
implementation runs on the same parameters. A tensor with per-expert data-dependent shapes never
enters a ``torch.compile`` graph: each grouped linear is one custom op there (``infir2.nn.moe.ops``).
On the CPU emulations the grouped linears take the rows per expert as a device tensor
(``infir2.nn.moe.offsets``: one quantize per cast, one grouped GEMM, the loop's numbers bit for bit);
elsewhere the rows per expert are read on the host once per block (``# MoE routing:``).
Supported: the layout of ``use_experts_implementation`` with a gate (concatenated ``[gate; up]``, no
bias, not transposed, no post-expert norm, no expert parallelism); other experts modules stay high
precision and ``convert_to_fp8`` warns about them.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ...fp8.accumulate import accumulation_dtype
from ...fp8.recipe import Fp8Recipe
from ...kernels import Kernels, Operand
from ..fsdp import Fp8GatheredWeight
from ..module import Fp8Module
from .grouped_linear import fp8_grouped_linear
from .offsets import fp8_grouped_linear_offsets, runs_on_offsets

__all__ = [
    "Fp8Experts",
    "expert_counts",
    "is_routed_experts",
    "unsupported_experts_reason",
]

#: the attributes ``use_experts_implementation`` sets on an experts class, and the values supported
_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}
# flags of the experts module that only newer transformers have (5.17 sets neither); unset means False
_NEWER_FLAGS = ("has_post_expert_norm", "_is_expert_parallel")


def unsupported_experts_reason(module: nn.Module) -> str | None:
    """Why ``module`` (which owns 3-D expert weights) is not a supported experts module; None if it is."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        return "no gate_up_proj / down_proj parameters"
    if gate_up.dim() != 3 or down.dim() != 3:
        return f"expert weights of {gate_up.dim()} / {down.dim()} dimensions, expected 3"
    e, two_i, h = gate_up.shape
    if tuple(down.shape) != (e, h, two_i // 2) or two_i % 2:
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not (E, 2I, H) / (E, H, I)"
    if not hasattr(getattr(module, "config", None), "_experts_implementation"):
        return "not a transformers v5 experts module (no config._experts_implementation)"
    for name, value in _LAYOUT.items():
        if getattr(module, name, None) != value:
            return f"{name}={getattr(module, name, None)} (supported: {value})"
    if any(getattr(module, name, False) for name in _NEWER_FLAGS):
        return "post-expert norm or expert parallelism"
    return None


def is_routed_experts(module: nn.Module) -> bool:
    """True for a transformers v5 experts module ``Fp8Experts`` can replace."""
    return not isinstance(module, Fp8Experts) and unsupported_experts_reason(module) is None


def _autocast_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert, ``[E]`` int64 (a static shape: traceable, unlike ``bincount``)."""
    counts = torch.zeros(num_experts, dtype=torch.long, device=expert_ids.device)
    return counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))


class Fp8Experts(Fp8Module):
    """The routed experts of one MoE block, their grouped GEMMs in FP8 (module doc).

    Holds the replaced module's own ``gate_up_proj`` / ``down_proj`` parameters (no copy) and its
    activation; ``fp8_enabled = False`` runs the original experts implementation instead. Inside
    ``infir2.nn.cache_fp8_weights`` each expert's weight is quantized once per step (a cache entry per
    weight: the list of its experts' operands). What it shares with every FP8 module (recipe, kernels,
    weight cache, registry key, stats) is ``infir2.nn.module.Fp8Module``.
    """

    FP8_WEIGHTS = ("gate_up_proj", "down_proj")

    gate_up_proj: nn.Parameter  # [E, 2I, H]
    down_proj: nn.Parameter  # [E, H, I]
    num_experts: int

    def __init__(self, experts: nn.Module, recipe: str | Fp8Recipe = "blockwise", backend: str | None = None):
        super().__init__()
        reason = unsupported_experts_reason(experts)
        if reason is not None:
            raise ValueError(f"cannot run {type(experts).__name__} in FP8: {reason}")
        self.gate_up_proj = cast(nn.Parameter, experts.gate_up_proj)
        self.down_proj = cast(nn.Parameter, experts.down_proj)
        self.act_fn = experts.act_fn
        self.experts_class = type(experts)  # its forward is the high-precision path (fp8 off)
        for name in ("config", "num_experts", *_LAYOUT):
            setattr(self, name, getattr(experts, name))
        for name in _NEWER_FLAGS:  # read by the experts forward of the transformers versions that set them
            if hasattr(experts, name):
                setattr(self, name, getattr(experts, name))
        self._init_fp8(recipe, backend)
        self.train(experts.training)

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        return f"experts={e}, hidden={h}, intermediate={two_i // 2}, recipe={self.recipe.name}, fp8_enabled={self.fp8_enabled}"

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The experts class's own gating (``act(gate) * up`` unless the family overrides it)."""
        return self.experts_class._apply_gate(self, gate_up)  # type: ignore[attr-defined]

    def quantized_weights(self, name: str, kernels: Kernels) -> list[Operand]:
        """Per-expert fprop operands of ``gate_up_proj`` or ``down_proj``, cached within a step."""
        w: torch.Tensor = getattr(self, name)
        if isinstance(w, Fp8GatheredWeight):  # all-gathered as FP8 codes by FSDP2 (infir2.nn.moe.fsdp)
            return list(w.operand.operands)  # type: ignore[attr-defined]
        key = self.weight_key(w, kernels)
        cached: list[Operand] | None = self.cached(name, key)
        if cached is not None:
            return cached
        with torch.no_grad():
            ops = [kernels.quantize(w[e].detach(), self.recipe.w) for e in range(w.shape[0])]
        self.store(name, key, ops)
        return ops

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if not self.fp8_enabled:
            return self.experts_class.forward(self, hidden_states, top_k_index, top_k_weights)
        tokens, top_k = top_k_index.shape
        expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)  # rows grouped by expert
        x = hidden_states[order // top_k].to(_autocast_dtype(hidden_states))  # [S, H], S = tokens * top_k
        counts = expert_counts(expert_ids, self.num_experts)
        h = self._grouped_linear(x, "gate_up_proj", counts, rows := self._rows(x, counts))  # [S, 2I]
        h = self._apply_gate(h)  # [S, I]
        y = self._grouped_linear(h, "down_proj", counts, rows)  # [S, H]
        # weighted in the rows' dtype (backward keeps y as it is), summed over the k experts in fp32
        y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        combined = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, k) order
        summed = combined.view(tokens, top_k, -1).sum(dim=1, dtype=accumulation_dtype(y.dtype))
        return summed.to(hidden_states.dtype)

    def _rows(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | list[int] | None:
        """How the grouped linears get the rows per expert: None under ``torch.compile`` (the custom op
        reads them), ``counts`` itself where the GEMMs run over device offsets (``infir2.nn.moe.offsets``),
        else a list read from the device once for both projections."""
        if torch.compiler.is_compiling():
            return None
        kernels = self._kernels_on(x.device)
        weights = (self.gate_up_proj, self.down_proj)
        if self.stats is None and all(runs_on_offsets(self.recipe, kernels, x, w) for w in weights):
            return counts
        rows: list[int] = counts.tolist()  # MoE routing: 1 read a block
        return rows

    def _grouped_linear(
        self, x: torch.Tensor, name: str, counts: torch.Tensor, rows: torch.Tensor | list[int] | None
    ) -> torch.Tensor:
        weight = getattr(self, name)
        if rows is None:  # compiling: one custom op, the per-expert loop stays outside the graph
            return torch.ops.infir2.fp8_grouped_linear(x, weight, counts, self.op_key, name)[0]
        kernels = self._kernels_on(x.device)
        w_ops = self.quantized_weights(name, kernels)
        if isinstance(rows, torch.Tensor):  # the counts stay on the device
            y: torch.Tensor = fp8_grouped_linear_offsets(x, weight, rows, self.recipe, kernels, w_ops)
            return y
        return fp8_grouped_linear(x, weight, rows, self.recipe, kernels, w_ops, self.recorder(name))
