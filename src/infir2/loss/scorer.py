"""The token scorer: each target token's log-probability (and the distribution's entropy) under a causal
LM's head, without the full ``[tokens, vocab]`` fp32 logits.

Training's cross-entropy, validation and ``infir2 eval --perplexity`` and every RL log-probability (old,
reference, policy) and entropy go through ``score_tokens``. The plain computation takes
``logits = hidden @ lm_head.weight.T`` for every token, upcasts them to fp32 and runs ``log_softmax``;
at 32k tokens and Qwen2.5's 151,936-word vocabulary the fp32 logits alone are 20 GB, autograd keeps them
until backward and then allocates a gradient of the same size, and RL's entropy ``exp(logp) * logp`` one
more. ``ChunkedTokenScorer`` walks the tokens ``chunk_tokens`` at a time instead, with ``T`` the
sampling temperature:

* forward, per chunk ``c``:  ``z_c = (h_c @ W.T) / T``  (``[c,H] @ [H,V] -> [c,V]`` in
  ``compute_dtype``, the logits as the model's head gives them, then upcast: fp32 math, fp64 for an fp64
  model), ``lse_c = logsumexp(z_c)``, ``logp = z_c[target] - lse_c`` and, when asked, the entropy
  ``H = lse - sum(softmax(z_c) * z_c)`` summed online from ``z_c - max`` and its ``exp`` (no third
  ``[c,V]`` block). Only ``lse`` and ``H`` (``[T]``) are kept for backward, besides the inputs autograd
  already holds.
* backward, per chunk: recompute ``z_c``, ``logp_c = z_c - lse`` and ``p_c = exp(logp_c)``;
  ``dz_c = g_logp * (onehot(target) - p_c) - g_H * p_c * (logp_c + H)``, divided by ``T``; then
  ``dh_c = dz_c @ W`` and ``dW += dz_c.T @ h_c`` (accumulated in the math dtype).

So the largest temporary is one ``[chunk_tokens, V]`` block in the math dtype (two while the entropy
or its gradient is computed: ``p`` beside ``logp``), plus the ``compute_dtype`` logits, whatever the
sequence length: each block is made in place of the last and dies before the next chunk's logits
(``tests/test_loss_scorer.py`` counts the live bytes). The price is one extra ``h @ W.T`` GEMM per
step (backward recomputes the logits instead of keeping them). Values match ``log_softmax((hidden @
weight.T).float() / T)`` to fp32 round-off (``tests/test_loss_scorer.py`` compares both, and their
gradients, with a float64 reference).

``chunk_tokens_for(setting, tokens, vocab)`` is the policy (``train.loss_chunk_tokens``): ``"auto"``
chunks when a micro-batch's fp32 logits would exceed ``AUTO_CHUNK_BYTES`` (256 MiB), and then at the
tokens whose logits fit in it; a micro-batch under that budget is scored from the model's own logits in
one piece (what autograd keeps is then within the budget).

``score_tokens(model, input_ids, targets, keep, ...)`` applies this to a Hugging Face causal LM: chunked,
it runs the model with ``logits_to_keep`` selecting no position (so no logits are made; the root module's
forward, and with it FSDP's hooks, still runs), captures the final hidden states of ``model.model`` and
uses ``model.get_output_embeddings().weight`` -- the token embedding when the two are tied, so the
gradient reaches the one shared parameter either way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..fp8.accumulate import accumulation_dtype

__all__ = [
    "AUTO_CHUNK_BYTES",
    "ChunkedTokenScorer",
    "auto_chunk_tokens",
    "chunk_tokens_for",
    "chunked_token_scores",
    "linear_cross_entropy_sum",
    "score_tokens",
]

#: ``"auto"``: the fp32 logits of one chunk stay under this many bytes, whatever the vocabulary (441
#: tokens at Qwen2.5's 151,936 words, 2,097 at 32,000); a micro-batch whose whole logits fit is not
#: chunked. BENCHMARKS.md measures the budget against the step time.
AUTO_CHUNK_BYTES = 256 << 20
FP32_BYTES = 4


def _logits(h: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    # [c,H] @ [H,V] -> [c,V] in `dtype` (the head's output dtype), then the math dtype, then / T
    z = (h.to(dtype) @ weight.to(dtype).t()).to(accumulation_dtype(dtype))
    return z if temperature == 1.0 else z.div_(temperature)


class ChunkedTokenScorer(torch.autograd.Function):
    """``(logp [T], entropy [T])`` of ``log_softmax(hidden @ weight.T / T)``, ``chunk_tokens`` rows at a
    time; ``entropy`` False returns an empty entropy (and skips its work)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [V, H]
        targets: torch.Tensor,  # [T] int64, valid ids
        temperature: float,
        chunk_tokens: int,
        compute_dtype: torch.dtype,
        entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, math_dtype = hidden.shape[0], accumulation_dtype(compute_dtype)
        lse = torch.empty(n, dtype=math_dtype, device=hidden.device)
        logp = torch.empty(n, dtype=math_dtype, device=hidden.device)
        ent = torch.empty(n if entropy else 0, dtype=math_dtype, device=hidden.device)
        for start in range(0, n, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            z = _logits(hidden[rows], weight, compute_dtype, temperature)
            target = z.gather(1, targets[rows, None])[:, 0]
            zmax = z.amax(dim=-1)
            s = z.sub_(zmax[:, None])  # in place of the logits: z - max
            if entropy:  # H = log S - sum(e * s) / S, with e = exp(s), S = sum(e)
                e = s.exp()
                total = e.sum(dim=-1)
                ent[rows] = total.log() - e.mul_(s).sum(dim=-1) / total
                del e
            else:
                total = s.exp_().sum(dim=-1)
            lse[rows] = total.log_().add_(zmax)
            logp[rows] = target - lse[rows]
            del z, s
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk_tokens, ctx.compute_dtype = temperature, chunk_tokens, compute_dtype
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(
        ctx: Any, grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        dtype, temperature = ctx.compute_dtype, ctx.temperature
        math_dtype = accumulation_dtype(dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nothing = grad_logp is None and (grad_ent is None or ent.numel() == 0)
        if nothing or not (need_h or need_w):
            return None, None, None, None, None, None, None
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=math_dtype, device=weight.device) if need_w else None
        w = weight.to(dtype)
        use_ent = grad_ent is not None and ent.numel() > 0
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            h = hidden[rows].to(dtype)
            g = None if grad_logp is None else grad_logp[rows, None].to(math_dtype)
            g_ent = None
            if use_ent and grad_ent is not None:  # the entropy and its incoming gradient, [c, 1] each
                g_ent = (ent[rows, None], grad_ent[rows, None].to(math_dtype))
            dz_c = _grad_logits(_logits(h, w, dtype, temperature), lse[rows], targets[rows], g, g_ent)
            if temperature != 1.0:
                dz_c.div_(temperature)
            dz_c = dz_c.to(dtype)
            if grad_h is not None:
                grad_h[rows] = dz_c @ w  # [c,V] @ [V,H] -> [c,H]
            if grad_w is not None and dtype == math_dtype:  # in place: no [V,H] temporary per chunk
                grad_w.addmm_(dz_c.t(), h)  # [V,c] @ [c,H] -> [V,H]
            elif grad_w is not None:  # one [V,H] product in `dtype`, added without an fp32 copy
                grad_w.add_(dz_c.t() @ h)  # [V,c] @ [c,H] -> [V,H]
            del dz_c  # before the next chunk's logits: one chunk's [c,V] gradient alive at a time
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def _grad_logits(
    z: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    g: torch.Tensor | None,
    g_ent: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """``dz = g * (onehot(target) - p) - g_H * p * (logp + H)`` of one chunk, from its logits ``z``
    (``[c,V]``, math dtype, consumed) and ``lse``, ``g`` and ``g_ent = (H, g_H)`` (``[c,1]`` each).

    Without the entropy's gradient ``p`` is made in place of ``z``: one ``[c,V]`` block (as the chunked
    CE did); with it ``logp`` and ``p`` are both needed, a second block that dies here."""
    logp_all = z.sub_(lse[:, None])  # in place of the logits
    if g_ent is None:
        assert g is not None
        dz = logp_all.exp_().mul_(-g)  # p, then -g * p, in place
    else:
        p = logp_all.exp()
        ent, grad_ent = g_ent
        coef = logp_all.add_(ent).mul_(-grad_ent)  # the factor, in place of logp
        if g is not None:
            coef.sub_(g)
        dz = p.mul_(coef)
    if g is not None:
        dz[torch.arange(len(g), device=dz.device), targets] += g[:, 0]
    return dz


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on (the head's GEMM runs in it), else ``hidden``'s dtype."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def chunked_token_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 2048,
    entropy: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax((hidden @ weight.T).float() / temperature)`` at ``targets``, and the entropy of that
    distribution when ``entropy``, without the full logits.

    ``hidden`` is ``[..., H]`` and ``targets`` the matching ``[...]`` (ids in ``[0, V)``; mask the rest
    afterwards); the outputs have ``targets``' shape, in fp32 (fp64 for fp64 inputs).
    ``compute_dtype`` is the head GEMM's dtype (default: the autocast dtype when autocast is on, else
    ``hidden``'s dtype).
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree")
    dtype = compute_dtype if compute_dtype is not None else _compute_dtype(hidden)
    with torch.autocast(hidden.device.type, enabled=False):
        logp, ent = ChunkedTokenScorer.apply(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            targets.reshape(-1),
            float(temperature),
            chunk_tokens,
            dtype,
            entropy,
        )
    return logp.view(targets.shape), ent.view(targets.shape) if entropy else None


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_tokens: int = 2048,
) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T).float(), labels, reduction="sum")`` without the full logits:
    ``-sum`` of ``chunked_token_scores`` over the labels that are not ``ignore_index``."""
    valid = labels != ignore_index
    logp, _ = chunked_token_scores(hidden, weight, labels.masked_fill(~valid, 0), chunk_tokens=chunk_tokens)
    return -torch.where(valid, logp, torch.zeros((), dtype=logp.dtype, device=logp.device)).sum()


def auto_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk whose fp32 logits ``[chunk, vocab]`` fit in ``AUTO_CHUNK_BYTES`` (at least 1)."""
    return max(1, AUTO_CHUNK_BYTES // (vocab * FP32_BYTES))


def chunk_tokens_for(setting: int | str | None, tokens: int, vocab: int) -> int | None:
    """The chunk size for a micro-batch of ``tokens`` scored tokens (None: score the model's logits whole).

    ``setting``: an int chunks at that many tokens; 0 or None never chunks; ``"auto"`` chunks at
    ``auto_chunk_tokens(vocab)`` (one chunk's fp32 logits within ``AUTO_CHUNK_BYTES``) when the whole
    micro-batch's logits would exceed that budget.
    """
    if setting == "auto":
        chunk = auto_chunk_tokens(vocab)
        return chunk if tokens > chunk else None
    if setting is None or setting == 0:
        return None
    if isinstance(setting, int) and not isinstance(setting, bool) and setting > 0:
        return setting
    raise ValueError(f"loss_chunk_tokens must be 'auto', 0 or a positive int, got {setting!r}")


def _head(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    decoder = getattr(model, "model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(decoder, nn.Module) or not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(
            f"{type(model).__name__}: the chunked scorer needs .model and a bias-free Linear lm_head"
        )
    return decoder, head


def score_tokens(
    model: nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    keep: int | None,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int | str | None = "auto",
    ignore_index: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, n]`` log-probabilities of ``targets`` (and the entropies) under a HF causal LM at ``temperature``.

    The hidden states that predict the targets are the last ``keep + 1`` positions less the final one
    (``keep`` = n: a response of n tokens after its prompt; the whole row but the last: ``keep =
    L - 1``); ``keep`` None: every position (a context shard's pre-shifted targets, n = L).
    ``chunk_tokens`` is ``chunk_tokens_for``'s setting. Targets equal to ``ignore_index`` score 0
    (their entropy too); other masking is the caller's.
    """
    n = input_ids.shape[1] if keep is None else keep
    if targets.shape != (input_ids.shape[0], n):
        raise ValueError(
            f"targets {tuple(targets.shape)}: expected {(input_ids.shape[0], n)} for keep={keep}"
        )
    valid = None if ignore_index is None else targets != ignore_index
    safe = targets if valid is None else targets.masked_fill(~valid, 0)
    head_rows = slice(None) if keep is None else slice(-(keep + 1), -1)
    # no KV cache: nothing reads it, and with one transformers ignores the documents of packed position_ids
    inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    inputs |= {"position_ids": position_ids, "use_cache": False}
    decoder, head = _head(model)
    chunk = chunk_tokens_for(chunk_tokens, targets.numel(), head.weight.shape[0])
    if chunk is None:  # under the budget: the model's logits, whole
        logits = model(**inputs, logits_to_keep=0 if keep is None else keep + 1).logits[:, head_rows]
        logp_all = F.log_softmax(
            logits.to(accumulation_dtype(logits.dtype)) / temperature, dim=-1
        )  # [B, n, V]
        logp = logp_all.gather(-1, safe[..., None])[..., 0]
        ent = -(logp_all.exp() * logp_all).sum(-1) if entropy else None
    else:
        captured: list[torch.Tensor] = []
        handle = decoder.register_forward_hook(lambda _m, _i, out: captured.append(out.last_hidden_state))
        try:  # no logits: keep zero positions of every row (the root forward still runs, for FSDP's hooks)
            # a 1-D index: the same positions of every row on every transformers (5.17 reads a 2-D one as
            # a plain index, [B, B, 0, H]; newer versions as per-row positions)
            none = torch.zeros(0, dtype=torch.long, device=input_ids.device)
            model(**inputs, logits_to_keep=none)
        finally:
            handle.remove()
        hidden = captured[0][:, head_rows]  # [B, n, H]
        logp, ent = chunked_token_scores(hidden, head.weight, safe, temperature, chunk, entropy)
    if valid is not None:  # zero, not times zero: a NaN at an ignored position stays out (F.cross_entropy's)
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        logp = torch.where(valid, logp, zero)
        ent = None if ent is None else torch.where(valid, ent, zero)
    return logp, ent
