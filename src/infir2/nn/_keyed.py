"""Objects by integer key, held weakly: how a ``torch.library`` custom op (plain values only) names a module."""

from __future__ import annotations

import itertools
import weakref
from typing import Generic, TypeVar

__all__ = ["KeyedRegistry"]

T = TypeVar("T")


class KeyedRegistry(Generic[T]):
    """``add(obj) -> key`` and ``get(key) -> obj`` while ``obj`` lives; a freed object's key is an error."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._objects: weakref.WeakValueDictionary[int, T] = weakref.WeakValueDictionary()
        self._keys = itertools.count()

    def add(self, obj: T) -> int:
        key = next(self._keys)
        self._objects[key] = obj
        return key

    def get(self, key: int) -> T:
        obj = self._objects.get(key)
        if obj is None:
            raise RuntimeError(f"no {self.kind} with key {key}: it was freed")
        return obj
