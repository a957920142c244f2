"""The one KV-cache sampler: a batch of prompts (token ids), one ``torch.Generator`` per sequence.

Prompts are left-padded (all continuations start at the same column, positions counted from each
prompt's first real token); the prompt is run once (``logits_to_keep=1``), then one token per step
through a ``transformers.DynamicCache``, handed to the model under the keyword its ``forward`` names
(``cache`` in newer transformers, ``past_key_values`` in older ones, whose ``**kwargs`` would swallow the
other name silently: ``cache_keyword``); after every forward the cache must have grown by the tokens fed,
else generation stops with an error instead of decoding from the newest token alone. Per step and sequence: ``logprobs = log_softmax(logits / T)``;
greedy takes the argmax, sampling draws one token from the sequence's own generator -- from
``softmax(logits / T)`` itself (RL: the policy the trainer scores), or after top-k / top-p filtering
(evaluation: the kept tokens renormalised, as transformers' ``TopKLogitsWarper`` / ``TopPLogitsWarper``
keep them). The log-probability returned is always that of ``softmax(logits / T)``. A sequence stops at
its first stop token (kept) or after ``max_new_tokens``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..data.base import left_pad_positions
from ..model import autocast
from ..nn.exact import MIN_ROWS, decoding
from .base import Sample, SamplingConfig

__all__ = ["cache_keyword", "filter_probs", "left_pad", "sample_batch"]

_CACHE_KEYWORDS = ("cache", "past_key_values")  # newest first


def cache_keyword(model: nn.Module) -> str:
    """The keyword under which ``model``'s forward takes its KV cache: ``cache`` (the name of newer
    transformers) or ``past_key_values`` (5.17 to 5.2x). Read from the signature of the Hugging Face model
    itself (under a PEFT wrapper: its base model); a forward naming neither is an error."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    params = inspect.signature(type(base).forward).parameters  # decorators keep __wrapped__'s signature
    for name in _CACHE_KEYWORDS:
        if name in params:
            return name
    raise TypeError(
        f"{type(base).__name__}.forward takes neither `cache` nor `past_key_values`: infir2 cannot hand it a "
        "KV cache (a Hugging Face causal LM of transformers >= 5.17 is expected)"
    )


def _check_cache_grew(cache, expected: int, keyword: str) -> None:
    """Raise unless the KV cache now holds ``expected`` positions: a cache the model did not fill means it
    was handed over under a name this transformers ignores, and every later token would be decoded from
    the newest token alone."""
    held = cache.get_seq_length()
    if held != expected:
        import transformers

        raise RuntimeError(
            f"the KV cache holds {held} positions after a forward that should leave {expected}: the model "
            f"did not use the cache passed as `{keyword}=` (transformers {transformers.__version__}); "
            "generation stopped rather than decode without its context"
        )


def left_pad(
    seqs: Sequence[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, W]`` ids and attention mask, each sequence right-aligned (W = the longest)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def filter_probs(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """``[B, V]`` probabilities with all but the top-k and the top-p nucleus zeroed (at least one kept)."""
    if top_k > 0 and top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # the mass of the tokens ranked above each
        drop_sorted = before >= top_p * sorted_p.sum(-1, keepdim=True)
        drop_sorted[:, 0] = False
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
    return probs


def _next_tokens(
    logprobs: torch.Tensor, gens: Sequence[torch.Generator], sampling: SamplingConfig
) -> torch.Tensor:
    if sampling.greedy:
        return logprobs.argmax(-1)
    probs = logprobs.exp()
    if sampling.top_p < 1.0 or sampling.top_k > 0:
        probs = filter_probs(probs, sampling.top_p, sampling.top_k)
    # each row from its own generator (one draw per row and token): a sample does not depend on its batch
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(gens)])


@torch.no_grad()
def sample_batch(
    model: nn.Module,
    prompts: Sequence[list[int]],
    gens: Sequence[torch.Generator],
    sampling: SamplingConfig,
    stop_ids: Sequence[int],
    pad_id: int,
    precision: str | None,
    exact: bool = False,
) -> list[Sample]:
    """One response per prompt (``gens[i]`` draws prompt i's tokens); ``precision`` the autocast of the
    high-precision parts (``model.autocast``; None: the model as it is). ``exact`` (a model switched by
    ``nn.exact.use_exact_numerics``): a batch runs with copies of the last prompt up to a multiple of
    ``nn.exact.MIN_ROWS`` rows (finished from the start, dropped), and the prompt's forward takes its last
    position by an index (a contiguous copy: ``lm_head`` on the strided last rows rounds otherwise)."""
    from contextlib import nullcontext

    from transformers import DynamicCache

    device = next(model.parameters()).device
    extra = -len(prompts) % MIN_ROWS if exact else 0
    ids, mask = left_pad(list(prompts) + [prompts[-1]] * extra, pad_id, device)
    gens = list(gens) + [torch.Generator(device=device).manual_seed(0) for _ in range(extra)]
    positions = left_pad_positions(mask)
    cache, keyword = DynamicCache(), cache_keyword(model)
    stops = torch.tensor(list(stop_ids), device=device)
    done = torch.arange(ids.shape[0], device=device) >= len(prompts)  # the copies: finished already
    tokens, logps = [], []
    temperature = sampling.temperature if sampling.temperature > 0 else 1.0  # greedy may say 0
    with (
        nullcontext() if precision is None else autocast(precision, device),
        decoding() if exact else nullcontext(),
    ):
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=_last_position(ids) if exact else 1,
            **{keyword: cache},
        )
        _check_cache_grew(cache, ids.shape[1], keyword)
        next_pos = positions[:, -1:] + 1
        limit = None if sampling.beyond_context else getattr(model.config, "max_position_embeddings", None)
        kept = [sampling.max_new_tokens] * ids.shape[0]  # tokens each row keeps (fewer: cut at the limit)
        for step in range(sampling.max_new_tokens):
            logprobs = F.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)
            tok = _next_tokens(logprobs, gens, sampling)
            tokens.append(torch.where(done, pad_id, tok))
            logps.append(logprobs.gather(1, tok[:, None]).squeeze(1))
            done = done | torch.isin(tok, stops)
            if limit is not None:  # the next token would sit past the trained positions: cut here
                at_limit = ~done & (next_pos[:, 0] >= limit)
                for i in at_limit.nonzero().flatten().tolist():
                    kept[i] = step + 1
                done = done | at_limit
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=next_pos,
                use_cache=True,
                **{keyword: cache},
            )
            _check_cache_grew(cache, mask.shape[1], keyword)
            next_pos = next_pos + 1
    all_ids, all_logps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()
    return [_sample(all_ids[i][: kept[i]], all_logps[i][: kept[i]], stop_ids) for i in range(len(prompts))]


def _last_position(ids: torch.Tensor) -> torch.Tensor:
    """``logits_to_keep`` as a 1-D index of the last column: transformers indexes the hidden states with
    it, a contiguous ``[B, 1, H]`` copy (an int slices them, a strided view)."""
    return torch.tensor([ids.shape[1] - 1], device=ids.device)


def _sample(ids: list[int], logps: list[float], stop_ids: Sequence[int]) -> Sample:
    stop_at = next((j for j, t in enumerate(ids) if t in stop_ids), None)
    keep = len(ids) if stop_at is None else stop_at + 1
    return Sample(ids[:keep], logps[:keep], finished=stop_at is not None)
