"""Exact numerics: a KV-cached decode step computes each token exactly as one full forward does.

A full forward of a padded batch and a decode step (one new row per sequence, attention over the KV
cache) run the same layers on different shapes, and the CPU kernels reduce in shape-dependent orders:
an fp32 GEMM of fewer than ``MIN_ROWS`` rows takes another path than a taller one (one thread,
``benchmarks/exact_sampler.py`` prints the probe), and ``scaled_dot_product_attention`` splits the
keys in blocks that depend on the query and key lengths. Measured on the CPU kernels torch 2.13 ships
(one intra-op thread): an fp32 GEMM of at least ``MIN_ROWS`` rows gives each row the same bits whatever
the other rows, and ``[M, D] @ [D, S]`` gives each score the same bits whatever ``S >= 16`` and the
key's column. What is left is made shape-free here, for both paths alike:

* **attention** (``exact_attention``, registered with transformers as ``ATTENTION``): each row's
  keys are moved to their canonical columns (key ``p`` of a sequence at column ``p``, whatever its
  left padding), the buffer rounded up to whole ``KEY_BLOCK``s; scores ``q @ k.T`` (at least
  query rows padded to a multiple of ``MIN_ROWS``), the masked row max, ``exp``; then
  ``[p @ v, sum(p)]`` one ``KEY_BLOCK`` of keys at a time (one GEMM of fixed shape per block, the
  sum a column of ones beside ``v``) and the blocks added in order. A block past a sequence's last
  key adds exact zeros, so a query's output does not depend on how many keys the buffer holds.
* **feed-forward blocks** (``row_padded``, each layer's ``mlp`` and every routed-experts module): a
  routed expert's GEMMs see as few rows as tokens were sent to it, and a GEMM of one output column (a
  shared expert's gate) rounds the rows past its last whole group of ``MIN_ROWS`` otherwise, so there
  the matmuls run on rows zero-padded to a multiple of ``MIN_ROWS``; and torch's elementwise loops compute a tensor's last
  elements (past its whole vectors) with the scalar function, whose ``sigmoid`` / ``silu`` round
  otherwise than the vectorized ones, so these run on tensors padded to whole ``MAP_BLOCK``s (a
  router's ``[tokens, experts]`` scores, a shared expert's ``[tokens, 1]`` gate).

The linear layers need nothing: a full forward has ``batch x length`` rows, a decode step one per
sequence, and the sampler pads a batch to a multiple of ``MIN_ROWS`` sequences. Row-wise kernels (RMSNorm's
mean, softmax, ``log_softmax``, elementwise maps over whole vectors) give a row the same bits at any
batch size already. Multi-threaded GEMMs split rows by thread and are not row-invariant: exactness is
measured at one intra-op thread. GPU kernels are not covered.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "ATTENTION",
    "KEY_BLOCK",
    "MAP_BLOCK",
    "MIN_ROWS",
    "exact_attention",
    "row_padded",
    "use_exact_numerics",
]

#: the attention implementation's name (``config._attn_implementation``)
ATTENTION = "infir2_exact"
#: the fewest rows of an fp32 CPU GEMM whose rows do not depend on each other (fewer take a gemv path)
MIN_ROWS = 4
#: elements per elementwise call: torch's CPU loops take whole vectors (2 x 16 floats with AVX-512) with
#: the vectorized function and the tail with the scalar one, which rounds ``sigmoid`` / ``silu`` otherwise
MAP_BLOCK = 64
#: keys per attention block (``p @ v`` one block at a time, the blocks summed in order)
KEY_BLOCK = 64


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [..., M, K]`` with zero rows appended up to ``rows`` (``x`` itself when it has enough)."""
    short = rows - x.shape[-2]
    return x if short <= 0 else torch.cat([x, x.new_zeros(*x.shape[:-2], short, x.shape[-1])], dim=-2)


#: (a weak reference to the mask, its canonical layout): every layer of a forward gets the same mask object
_LAST: list[Any] = []


def _canonical(mask: torch.Tensor, key_len: int, lq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each row's keys go so that key ``p`` lands at canonical column ``p`` -- the flat rows of
    ``[B * Lk]`` to take (``[B * S]``, S whole ``KEY_BLOCK``s) -- and which canonical keys each query
    sees (``[B, Lq, S]``: causal, this row's keys), from transformers' 4-D bool mask (computed once per
    mask object: once per forward)."""
    if _LAST and _LAST[0]() is mask:
        return _LAST[1]
    real = mask[:, 0, -1]  # [B, Lk]: the last query sees every key of its row (a right pad's too)
    count = real.sum(-1)
    first = (real.cumsum(-1) == 0).sum(-1)
    last = torch.where(real, torch.arange(key_len, device=mask.device), -1).amax(-1)
    if bool(((last - first + 1 != count) & (count > 0)).any()):
        raise ValueError("exact attention: a row's tokens must be contiguous (left or right padding only)")
    width = -(-key_len // KEY_BLOCK) * KEY_BLOCK
    cols = torch.arange(width, device=mask.device)
    index = (cols[None] + first[:, None]).clamp(max=key_len - 1)
    rows = index + torch.arange(mask.shape[0], device=mask.device)[:, None] * key_len  # [B, S] of B * Lk
    position = torch.arange(key_len - lq, key_len, device=mask.device)[None] - first[:, None]  # [B, Lq]
    sees = (cols[None, None] <= position[:, :, None]) & (cols < count[:, None])[:, None]
    _LAST[:] = [weakref.ref(mask), (rows, sees, count)]
    return rows, sees, count


_DECODING: list[dict[int, Any]] = []  # inside ``decoding()``: each attention layer's canonical K/V


@contextmanager
def decoding() -> Iterator[None]:
    """While a KV-cached generation runs: each attention layer keeps its keys and values in canonical
    columns from one step to the next and writes only the new token's (instead of re-laying the whole
    cache each step); dropped at exit."""
    _DECODING.append({})
    try:
        yield
    finally:
        _DECODING.pop()


def _keys(x: torch.Tensor, rows: torch.Tensor, width: int, ones: bool = False) -> torch.Tensor:
    """``x [B, Hkv, Lk, D]`` at the canonical columns (``rows [B, S]``: flat rows of ``B * Lk``):
    ``[B, Hkv, S, D]`` contiguous, one ``index_select`` (``ones``: a column of ones appended first)."""
    b, hkv, lk, d = x.shape
    if ones:
        x, d = F.pad(x, (0, 1), value=1.0), d + 1
    batch, head = rows.div(lk, rounding_mode="floor"), torch.arange(hkv, device=x.device)
    flat = ((batch[:, None] * hkv + head[None, :, None]) * lk + (rows - batch * lk)[:, None]).reshape(-1)
    return x.reshape(b * hkv * lk, d).index_select(0, flat).view(b, hkv, width, d)


def _canonical_kv(
    module: nn.Module,
    key: torch.Tensor,
    value: torch.Tensor,
    rows: torch.Tensor,
    count: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``key`` and ``value`` at the canonical columns (``[B, Hkv, S, D]``, ``[B, Hkv, S, Dv + 1]`` with
    the column of ones); under ``decoding()`` a one-token step extends the layer's last layout in place
    (the same values in the same columns: the newest key of a row at column ``count - 1``)."""
    state = _DECODING[-1] if _DECODING else None
    held = state.get(id(module)) if state is not None else None
    b, lk = key.shape[0], key.shape[2]
    if held is not None and held[0] == lk - 1 and held[1].shape[0] == b:
        _, k, v = held
        if k.shape[2] < width:  # one more block of keys: zeros, masked until written
            k, v = F.pad(k, (0, 0, 0, width - k.shape[2])), F.pad(v, (0, 0, 0, width - v.shape[2]))
        at = torch.arange(b, device=key.device)
        k[at, :, count - 1] = key[:, :, -1]
        v[at, :, count - 1] = F.pad(value[:, :, -1], (0, 1), value=1.0)
    else:
        k, v = _keys(key, rows, width), _keys(value, rows, width, ones=True)
    if state is not None:
        state[id(module)] = (lk, k, v)
    return k, v


def exact_attention(
    module: nn.Module,
    query: torch.Tensor,  # [B, H, Lq, D]
    key: torch.Tensor,  # [B, Hkv, Lk, D]
    value: torch.Tensor,  # [B, Hkv, Lk, Dv]
    attention_mask: torch.Tensor | None,  # [B, 1, Lq, Lk] bool (``exact_mask``)
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Softmax attention whose every query row is computed the same way at any batch, query and cache
    length (the module doc); transformers' attention-function contract: returns ``[B, Lq, H, Dv]``."""
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError(
            "exact attention supports full causal attention only (no sliding window, no softcap)"
        )
    b, h, lq, d = query.shape
    hkv, lk, dv = key.shape[1], key.shape[2], value.shape[-1]
    rep = h // hkv
    if attention_mask is None:
        attention_mask = torch.ones(b, 1, lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
    flat, sees, count = _canonical(attention_mask, lk, lq)
    width = sees.shape[-1]
    k, v = _canonical_kv(module, key, value, flat, count, width)  # v's column of ones sums p
    rows = -(-(rep * lq) // MIN_ROWS) * MIN_ROWS  # whole groups of MIN_ROWS query rows
    # head hkv*rep + r reads kv head hkv; every GEMM operand contiguous (a strided one rounds otherwise)
    q = _pad_rows(query.reshape(b, hkv, rep * lq, d), rows).contiguous()
    sees = _pad_rows(sees[:, None].expand(b, rep, lq, width).reshape(b, rep * lq, width), rows)
    scale = d**-0.5 if scaling is None else scaling
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [B, Hkv, M, S]
    scores = scores.masked_fill_(~sees[:, None], float("-inf"))
    top = scores.amax(-1, keepdim=True).detach()  # softmax does not depend on it
    p = (scores - torch.where(torch.isfinite(top), top, torch.zeros_like(top))).exp_()
    if dropout > 0.0 and module.training:
        p = F.dropout(p, dropout)
    blocks = width // KEY_BLOCK
    p = p.view(b, hkv, rows, blocks, KEY_BLOCK).transpose(2, 3).contiguous()  # [B, Hkv, nb, M, KB]
    parts = torch.matmul(p, v.view(b, hkv, blocks, KEY_BLOCK, dv + 1))  # [B, Hkv, nb, M, Dv+1]
    acc = parts[:, :, 0]
    for i in range(1, blocks):  # in key order: a block of masked keys adds exact zeros
        acc = acc + parts[:, :, i]
    den = acc[..., dv:]
    out = torch.where(den > 0, acc[..., :dv] / den.clamp(min=torch.finfo(den.dtype).tiny), 0.0)
    out = out[:, :, : rep * lq].reshape(b, h, lq, dv)
    return out.transpose(1, 2).contiguous(), None


def exact_mask(**kwargs: Any) -> torch.Tensor | None:
    """transformers' bool mask (``sdpa_mask``), always materialized: ``exact_attention`` reads each
    row's keys from it."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(**kwargs)


class _RowPadded(TorchFunctionMode):
    """Matmuls by a 2-D right operand run on rows padded with zeros to a multiple of ``MIN_ROWS`` (a
    ``[M, K] @ [K, 1]`` gemv gives the rows past the last whole group of four other bits); a grouped
    GEMM (``torch._grouped_mm``, ``F.grouped_mm``: one group of rows per expert) runs as one such matmul
    per group; ``sigmoid`` and ``silu`` run on whole ``MAP_BLOCK``s (a router's ``[M, E]`` scores, a
    shared expert's ``[M, 1]`` gate)."""

    _OPS: ClassVar[set[Any]] = {
        F.linear,
        torch.matmul,
        torch.mm,
        torch.Tensor.__matmul__,
        torch.Tensor.matmul,
        torch.Tensor.mm,
    }
    _MAPS: ClassVar[set[Any]] = {torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid, F.silu}
    _GROUPED: ClassVar[set[Any]] = {getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self._MAPS and args and isinstance(args[0], torch.Tensor):
            x = args[0]  # whole vectors only: a tail element takes the scalar function, other bits
            flat = x.reshape(-1)
            padded = torch.cat([flat, flat.new_zeros(-flat.numel() % MAP_BLOCK)])
            return func(padded)[: flat.numel()].view(x.shape)
        if func in self._GROUPED and func is not None:
            return _grouped_by_rows(*args, **kwargs)
        if func in self._OPS and len(args) >= 2 and isinstance(args[0], torch.Tensor):
            x, w = args[0], args[1]
            rows = x.numel() // max(x.shape[-1], 1) if x.dim() >= 2 else 0
            if isinstance(w, torch.Tensor) and w.dim() == 2 and rows % MIN_ROWS:
                flat = _pad_rows(x.reshape(rows, x.shape[-1]), -(-rows // MIN_ROWS) * MIN_ROWS)
                out = func(flat, *args[1:], **kwargs)[:rows]
                return out.reshape(*x.shape[:-1], out.shape[-1])
        return func(*args, **kwargs)


def _grouped_by_rows(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, **kwargs: Any
) -> torch.Tensor:
    """``cat_g(a[rows_g] @ b[g])`` (``a [S, K]``, ``b [G, K, N]``, ``offs [G]`` each group's end row), each
    group a matmul of a multiple of ``MIN_ROWS`` rows: its rows' bits do not depend on the group's size."""
    if offs is None or a.dim() != 2 or b.dim() != 3 or kwargs.get("bias") is not None:
        raise ValueError(
            "exact numerics: a grouped GEMM of 2-D rows by 3-D expert weights with offs is expected"
        )
    ends = offs.tolist()  # off the hot path: rollout.exact's CPU grouped GEMM, one matmul per group by design
    parts, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            rows = -(-(end - start) // MIN_ROWS) * MIN_ROWS
            parts.append(torch.matmul(_pad_rows(a[start:end], rows), b[g])[: end - start])
        start = end
    if start < a.shape[0]:  # rows past the last group: no expert's (zeros)
        parts.append(a.new_zeros(a.shape[0] - start, b.shape[-1]))
    out = torch.cat(parts) if parts else a.new_zeros(0, b.shape[-1])
    dtype = kwargs.get("out_dtype")
    return out if dtype is None else out.to(dtype)


def row_padded(module: nn.Module) -> None:
    """Run ``module``'s forward under ``_RowPadded`` (hooks, so a deep copy keeps them)."""
    module.register_forward_pre_hook(_enter_row_padded)
    module.register_forward_hook(_exit_row_padded, always_call=True)


_MODES: list[_RowPadded] = []


def _enter_row_padded(_module: nn.Module, _args: Any) -> None:
    mode = _RowPadded()
    mode.__enter__()
    _MODES.append(mode)


def _exit_row_padded(_module: nn.Module, _args: Any, _out: Any) -> None:
    _MODES.pop().__exit__(None, None, None)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, exact_attention)
    AttentionMaskInterface.register(ATTENTION, exact_mask)


def use_exact_numerics(model: nn.Module) -> nn.Module:
    """Switch a Hugging Face causal LM to exact numerics in place: ``exact_attention``, and each layer's
    feed-forward block (``.mlp``) and routed experts under ``row_padded``. Both the trainer's model and
    the engine's copy of it must be switched (``BuiltinEngine(exact=True)`` switches its own)."""
    from ..nn.moe import is_routed_experts
    from ..nn.moe.experts import Fp8Experts

    _register()
    getattr(model, "set_attn_implementation")(ATTENTION)  # noqa: B009 - a transformers model's method
    for name, module in model.named_modules():
        ffn = name.endswith(".mlp") or isinstance(module, Fp8Experts) or is_routed_experts(module)
        if ffn and not getattr(module, "_infir2_row_padded", False):
            row_padded(module)
            setattr(module, "_infir2_row_padded", True)  # noqa: B010 - a flag on any module
    return model
