"""Batched sampling with ``transformers`` ``generate`` (KV cache, left padding).

Prompts are rendered by ``infir2.data.chat.render_prompt`` (system prompt, chat template, the assistant
turn opened with ``"<think>\\n"``; re-exported here) and generation stops at
``infir2.data.chat.stop_token_ids`` (``<|im_end|>`` or the tokenizer's eos): the same markers SFT
trains on and the export's generation config names. Prompts of a batch are left-padded (so all
continuations start at the same column), sorted by length to waste little padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..data.chat import SYSTEM_PROMPT, THINK_PREFIX, render_prompt, stop_token_ids

__all__ = ["SYSTEM_PROMPT", "THINK_PREFIX", "Completion", "SamplingConfig", "generate", "render_prompt"]


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings; ``greedy`` ignores temperature / top_p (the authors sample at 0.65 / 0.95)."""

    greedy: bool = False
    temperature: float = 0.65
    top_p: float = 0.95
    max_new_tokens: int = 1024
    batch_size: int = 8

    def __post_init__(self) -> None:
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError(
                f"max_new_tokens and batch_size must be >= 1, got {self.max_new_tokens}, {self.batch_size}"
            )


@dataclass(frozen=True)
class Completion:
    text: str
    n_tokens: int
    finished: bool  # stopped at a stop token (False: cut at max_new_tokens)


def _stop_ids(tokenizer) -> list[int]:
    ids = sorted(set(stop_token_ids(tokenizer)))
    if not ids:
        raise ValueError("the tokenizer has neither <|im_end|> nor an eos token: generation could never stop")
    return ids


def _left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


def _generation_config(cfg: SamplingConfig, stop_ids: list[int], pad_id: int):
    from transformers import GenerationConfig

    sampling = {} if cfg.greedy else {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0}
    return GenerationConfig(
        do_sample=not cfg.greedy,
        max_new_tokens=cfg.max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        use_cache=True,
        **sampling,
    )


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    cfg: SamplingConfig,
    desc: str = "generate",
    progress: bool = True,
    on_done: Callable[[int, Completion], None] | None = None,
) -> list[Completion]:
    """Complete each prompt once (repeat a prompt for several samples); results in input order.

    ``on_done(index, completion)`` is called for every prompt as soon as its batch is finished.
    """
    stop_ids = _stop_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    gen_cfg = _generation_config(cfg, stop_ids, pad_id)
    device = next(model.parameters()).device
    out: list[Completion | None] = [None] * len(prompts)
    with tqdm(total=len(prompts), desc=desc, unit="seq", disable=not progress) as bar:
        for start in range(0, len(order), cfg.batch_size):
            batch = order[start : start + cfg.batch_size]
            ids, mask = _left_pad([encoded[i] for i in batch], pad_id)
            seqs = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_cfg
            )
            for row, i in enumerate(batch):
                out[i] = c = _completion(seqs[row, ids.shape[1] :].tolist(), stop_ids, pad_id, tokenizer)
                if on_done is not None:
                    on_done(i, c)
            bar.update(len(batch))
    return [c for c in out if c is not None]


def _completion(new_ids: list[int], stop_ids: list[int], pad_id: int, tokenizer) -> Completion:
    stop_at = next((j for j, t in enumerate(new_ids) if t in stop_ids), None)
    kept = new_ids if stop_at is None else new_ids[:stop_at]
    text = tokenizer.decode(kept, skip_special_tokens=True)  # as serving engines return it
    return Completion(text=text, n_tokens=len(kept) + (stop_at is not None), finished=stop_at is not None)
