"""Next-token cross-entropy without the full ``[tokens, vocab]`` logits: a chunked linear + CE.

The plain loss computes ``logits = hidden @ lm_head.weight.T`` for every token, upcasts them to fp32
and runs ``F.cross_entropy``. At 32k tokens and Qwen2.5's 151,936-word vocabulary the fp32 logits
alone are 20 GB, and autograd keeps them (or their softmax) until backward and then allocates a
gradient of the same size. ``ChunkedLinearCrossEntropy`` instead walks the tokens ``chunk_tokens``
at a time:

* forward, per chunk ``c``:  ``z_c = h_c @ W.T``  (``[c,H] @ [H,V] -> [c,V]``, in ``compute_dtype``),
  upcast to fp32, ``lse_c = logsumexp(z_c)``, ``loss += sum(lse_c - z_c[label])`` over the tokens
  whose label is not ``ignore_index``. Only ``lse`` (``[T]`` fp32) is kept for backward, besides the
  inputs autograd already holds.
* backward, per chunk: recompute ``z_c`` the same way, ``dz_c = g * (softmax(z_c) - onehot(label))``
  (zero on ignored tokens), then ``dh_c = dz_c @ W`` (``[c,V] @ [V,H] -> [c,H]``) and
  ``dW += dz_c.T @ h_c`` (``[V,c] @ [c,H] -> [V,H]``, accumulated in fp32).

So the largest temporary is ``[chunk_tokens, V]`` fp32 (plus its ``compute_dtype`` copy), whatever
the sequence length; the price is one extra ``h @ W.T`` GEMM per step (the backward recomputes the
logits instead of keeping them). Values match ``F.cross_entropy(reduction="sum")`` on the fp32-upcast
logits of the same GEMM to fp32 round-off; ``dW`` is summed over chunks in fp32 (the unchunked GEMM
rounds it once to ``compute_dtype``), so under bf16 it is, if anything, closer to exact.

``lm_loss_sum(model, input_ids, labels, ...)`` applies this to a Hugging Face causal LM: it runs the
model with ``logits_to_keep`` selecting no position (so no logits are made; the root module's forward,
and with it FSDP's hooks, still runs), captures the final hidden states of ``model.model``, and uses
``model.get_output_embeddings().weight`` -- which is the token embedding when the two are tied, so the
gradient reaches the one shared parameter either way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "AUTO_CHUNK_BYTES",
    "ChunkedLinearCrossEntropy",
    "auto_chunk_tokens",
    "chunked_linear_cross_entropy",
    "lm_loss_sum",
    "use_chunked_loss",
]

DEFAULT_CHUNK_TOKENS = 2048
#: ``train.loss_chunk_tokens: auto``: the fp32 logits of one chunk stay under this many bytes, whatever
#: the vocabulary (441 tokens at Qwen2.5's 151,936 words, 2,097 at 32,000); a micro-batch whose whole
#: logits fit is not chunked. BENCHMARKS.md measures the budget against the step time.
AUTO_CHUNK_BYTES = 256 << 20


def _logits(h: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # [c,H] @ [H,V] -> [c,V] in `dtype` (fp32 accumulate), then fp32 as the plain loss upcasts
    return (h.to(dtype) @ weight.to(dtype).t()).float()


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed CE of ``hidden @ weight.T`` against ``labels``, ``chunk_tokens`` rows at a time."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [V, H]
        labels: torch.Tensor,  # [T] int64
        ignore_index: int,
        chunk_tokens: int,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        lse = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            z = _logits(hidden[rows], weight, compute_dtype)
            valid = labels[rows] != ignore_index
            target = z.gather(1, labels[rows].clamp_min(0)[:, None])[:, 0]
            # logsumexp in place of the logits (no second [c, V] temporary): max + log(sum(exp(z - max)))
            zmax = z.amax(dim=-1)
            lse[rows] = z.sub_(zmax[:, None]).exp_().sum(dim=-1).log_().add_(zmax)
            total += ((lse[rows] - target) * valid).sum()
            del z
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.ignore_index, ctx.chunk_tokens, ctx.compute_dtype = ignore_index, chunk_tokens, compute_dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, lse = ctx.saved_tensors
        dtype = ctx.compute_dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        w = weight.to(dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            h = hidden[rows].to(dtype)
            z = _logits(h, w, dtype)
            dz = z.sub_(lse[rows, None]).exp_()  # softmax, in place of the logits
            lab = labels[rows]
            valid = lab != ctx.ignore_index
            dz[torch.arange(len(lab), device=dz.device), lab.clamp_min(0)] -= 1.0
            dz.mul_((grad_out * valid)[:, None])
            dz_c = dz.to(dtype)
            del dz
            if grad_h is not None:
                grad_h[rows] = dz_c @ w  # [c,V] @ [V,H] -> [c,H]
            if grad_w is None:
                continue
            if dtype == torch.float32:  # in place: no [V,H] temporary per chunk
                grad_w.addmm_(dz_c.t(), h)  # [V,c] @ [c,H] -> [V,H]
            else:  # one [V,H] product in `dtype`, added into the fp32 sum without an fp32 copy
                grad_w.add_(dz_c.t() @ h)  # [V,c] @ [c,H] -> [V,H]
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T).float(), labels, reduction="sum")`` without the full logits.

    ``hidden`` is ``[..., H]`` and ``labels`` the matching ``[...]``; ``compute_dtype`` is the GEMM
    dtype (default: the autocast dtype when autocast is on, else ``hidden``'s dtype).
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree")
    if compute_dtype is None:
        device = hidden.device.type
        on = torch.is_autocast_enabled(device)
        compute_dtype = torch.get_autocast_dtype(device) if on else hidden.dtype
    with torch.autocast(hidden.device.type, enabled=False):
        out = ChunkedLinearCrossEntropy.apply(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            labels.reshape(-1),
            ignore_index,
            chunk_tokens,
            compute_dtype,
        )
    return out


def auto_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk whose fp32 logits ``[chunk, vocab]`` fit in ``AUTO_CHUNK_BYTES`` (at least 1)."""
    return max(1, AUTO_CHUNK_BYTES // (vocab * (torch.finfo(torch.float32).bits // 8)))


def use_chunked_loss(setting: int | str | None, tokens: int, vocab: int) -> int | None:
    """The chunk size for a micro-batch of ``tokens`` (None: the plain loss).

    ``setting``: an int chunks at that many tokens; 0 or None never chunks; ``"auto"`` chunks at
    ``auto_chunk_tokens(vocab)`` (one chunk's fp32 logits within ``AUTO_CHUNK_BYTES``) when the whole
    micro-batch's logits would exceed that budget.
    """
    if setting == "auto":
        chunk = auto_chunk_tokens(vocab)
        return chunk if tokens > chunk else None
    if setting is None or setting == 0:
        return None
    if isinstance(setting, int) and setting > 0:
        return setting
    raise ValueError(f"loss_chunk_tokens must be 'auto', 0 or a positive int, got {setting!r}")


def lm_loss_sum(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
    position_ids: torch.Tensor | None = None,
    shifted: bool = False,
) -> torch.Tensor:
    """Summed next-token CE of a HF causal LM, chunked unless ``chunk_tokens`` is None. Labels are shifted
    here, unless ``shifted`` (a context shard's: ``labels[:, t]`` is the target of token ``t``)."""
    keep = slice(None) if shifted else slice(None, -1)  # the positions whose hidden state predicts
    targets = labels if shifted else labels[:, 1:]
    # no KV cache: nothing reads it, and with one transformers ignores the documents of packed position_ids
    inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    inputs |= {"position_ids": position_ids, "use_cache": False}
    if chunk_tokens is None:
        logits = model(**inputs).logits[:, keep]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, or fp64 as it is
        return F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=ignore_index,
            reduction="sum",
        )
    decoder = getattr(model, "model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(decoder, nn.Module) or not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(f"{type(model).__name__}: chunked loss needs .model and a bias-free Linear lm_head")
    captured: list[torch.Tensor] = []
    handle = decoder.register_forward_hook(lambda _m, _i, out: captured.append(out.last_hidden_state))
    try:  # no logits: keep zero positions of every row (the root forward still runs, for FSDP's hooks)
        none = torch.zeros(input_ids.shape[0], 0, dtype=torch.long, device=input_ids.device)
        model(**inputs, logits_to_keep=none)
    finally:
        handle.remove()
    hidden = captured[0][:, keep]  # [B, L-1, H] ([B, l, H] shifted)
    return chunked_linear_cross_entropy(hidden, head.weight, targets, ignore_index, chunk_tokens)
