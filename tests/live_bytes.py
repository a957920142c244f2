"""``LiveBytes``: the high-water mark of the bytes that ops allocate, counted per storage from the op
that made it until it is freed (a ``TorchDispatchMode``; storages are weak-referenced, so a freed one
leaves the count at once). Views and in-place results share their input's storage and add nothing.

``vocab`` set: only ``[*, vocab]`` blocks are counted (logits, probabilities, their gradient), not the
head's weight-shaped ``[hidden, vocab]`` transpose; what a loss's memory bound is about.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """``peak``: the most bytes held at once by storages allocated under the mode (``now``: at present)."""

    def __init__(self, vocab: int | None = None, hidden: int | None = None) -> None:
        super().__init__()
        self.vocab, self.hidden = vocab, hidden
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _counted(self, t: torch.Tensor) -> bool:
        if self.vocab is None:
            return True
        return t.dim() >= 2 and t.shape[-1] == self.vocab and t.shape != (self.hidden, self.vocab)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        flat = tree_flatten((args, kwargs))[0]
        inputs = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or not self._counted(t):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() and key not in inputs and key not in self.live:
                self.live[key] = storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._free, key)
        return out
