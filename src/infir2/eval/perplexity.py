"""Held-out loss and perplexity of a causal LM on a token file (for CPT checkpoints).

The token file is ``<dir>/val.bin`` (raw little-endian ids; dtype ``meta.json["dtype"]``, ``uint16``
or ``uint32``; the layout the data layer writes). It is cut into consecutive, non-overlapping
windows of ``seq_len + 1`` tokens that share their boundary token, so every token after the first is
predicted exactly once from up to ``seq_len`` tokens of context::

    window w: inputs = ids[w*L : w*L + L], targets = ids[w*L + 1 : w*L + L + 1]

loss = (sum of token cross-entropies in fp32) / (number of predicted tokens), perplexity = exp(loss).
A trailing partial window is scored too. Documents are not isolated (the eos separator is just a
token), which matches how CPT trains on packed sequences.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..nn import disable_fp8

__all__ = ["LossResult", "evaluate_loss", "read_tokens"]

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass(frozen=True)
class LossResult:
    loss: float
    perplexity: float
    tokens: int  # predicted tokens

    def as_dict(self) -> dict[str, float | int]:
        return {"loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens}


def read_tokens(token_dir: str | Path, split: str = "val") -> np.ndarray:
    """Memory-map ``<token_dir>/<split>.bin`` with the dtype from ``<token_dir>/meta.json``."""
    token_dir = Path(token_dir)
    meta_path, bin_path = token_dir / "meta.json", token_dir / f"{split}.bin"
    for p in (meta_path, bin_path):
        if not p.is_file():
            raise FileNotFoundError(
                f"token file missing: {p} (expected <dir>/{split}.bin and <dir>/meta.json)"
            )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_path}: not valid JSON ({e.msg})") from None
    dtype = meta.get("dtype") if isinstance(meta, dict) else None
    if dtype not in _DTYPES:
        raise ValueError(f"{meta_path}: key 'dtype' must be one of {sorted(_DTYPES)}, got {dtype!r}")
    tokens = np.memmap(bin_path, dtype=np.dtype(_DTYPES[dtype]).newbyteorder("<"), mode="r")
    if len(tokens) < 2:
        raise ValueError(f"{bin_path}: needs at least 2 tokens, has {len(tokens)}")
    return tokens


def _windows(n_tokens: int, seq_len: int, max_windows: int | None) -> list[tuple[int, int]]:
    starts = range(0, n_tokens - 1, seq_len)
    spans = [(s, min(s + seq_len + 1, n_tokens)) for s in starts]
    return spans[:max_windows] if max_windows else spans


@torch.no_grad()
def evaluate_loss(
    model: torch.nn.Module,
    token_dir: str | Path,
    seq_len: int = 1024,
    batch_size: int = 4,
    max_windows: int | None = None,
    split: str = "val",
    fp8: bool = False,
) -> LossResult:
    """Token-weighted mean cross-entropy over ``<token_dir>/<split>.bin`` (see the module docstring)."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    tokens = read_tokens(token_dir, split)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and int(tokens.max()) >= vocab:
        raise ValueError(
            f"{token_dir}/{split}.bin holds token id {int(tokens.max())} >= the model's vocab_size {vocab}"
        )
    spans = _windows(len(tokens), seq_len, max_windows)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with disable_fp8(model) if not fp8 else contextlib.nullcontext(model):
            for i in tqdm(range(0, len(spans), batch_size), desc="perplexity", unit="batch"):
                batch = spans[i : i + batch_size]
                nll, n = _batch_nll(model, tokens, batch, device)
                total, count = total + nll, count + n
    finally:
        model.train(was_training)
    loss = total / count
    return LossResult(loss=loss, perplexity=math.exp(loss), tokens=count)


def _batch_nll(
    model, tokens: np.ndarray, spans: list[tuple[int, int]], device: torch.device
) -> tuple[float, int]:
    width = max(e - s for s, e in spans)
    ids = torch.zeros((len(spans), width), dtype=torch.long)
    mask = torch.zeros((len(spans), width), dtype=torch.long)
    for row, (s, e) in enumerate(spans):
        ids[row, : e - s] = torch.from_numpy(np.asarray(tokens[s:e], dtype=np.int64))
        mask[row, : e - s] = 1
    ids, mask = ids.to(device), mask.to(device)
    logits = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1]).logits.float()  # [B, L, V]
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)  # right padding is ignored
    nll = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return float(nll), int((targets != -100).sum())
