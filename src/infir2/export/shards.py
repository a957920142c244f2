"""Stream tensors in and out of sharded safetensors checkpoints, one shard in memory at a time.

Writing follows the Hugging Face convention: ``model-00001-of-00003.safetensors`` ... (a single shard:
``model.safetensors``) plus ``model.safetensors.index.json`` = ``{"metadata": {"total_size": <bytes>}, "weight_map": {name: file}}``.
Reading accepts a single ``model.safetensors`` or an index with its shards; ``safe_open`` memory-maps
each file so a tensor is read only when asked for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ._files import default_permissions

__all__ = ["INDEX_NAME", "CheckpointReader", "ShardWriter", "parse_size"]

INDEX_NAME = "model.safetensors.index.json"
_SINGLE_NAME = "model.safetensors"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """``"5GB"`` / ``"500MiB"`` / ``123`` -> bytes."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, re.IGNORECASE)
        if not m:
            raise ValueError(f"shard size {size!r}: expected bytes or a number with KB/MB/GB/KiB/MiB/GiB")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value < 1:
        raise ValueError(f"shard size must be positive, got {size!r}")
    return value


class CheckpointReader:
    """Lazy access to the tensors of a safetensors checkpoint folder (single file or index + shards)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.weight_map = self._weight_map()
        self._handles: dict[str, object] = {}

    def _weight_map(self) -> dict[str, str]:
        index, single = self.folder / INDEX_NAME, self.folder / _SINGLE_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from None
            for file in set(weight_map.values()):
                if not (self.folder / file).is_file():
                    raise FileNotFoundError(f"{index}: shard {file} is missing")
            return dict(weight_map)
        if single.is_file():
            with safe_open(str(single), framework="pt") as f:
                return dict.fromkeys(f.keys(), _SINGLE_NAME)
        hint = (
            " (found pytorch_model*.bin: re-save with safetensors)" if any(self.folder.glob("*.bin")) else ""
        )
        raise FileNotFoundError(f"{self.folder}: no {INDEX_NAME} or {_SINGLE_NAME}{hint}")

    @property
    def files(self) -> list[str]:
        """Shard file names in first-appearance order."""
        return list(dict.fromkeys(self.weight_map.values()))

    def names_in(self, file: str) -> list[str]:
        return [n for n, f in self.weight_map.items() if f == file]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.folder / file), framework="pt")
        return self._handles[file].get_tensor(name)  # type: ignore[attr-defined]

    def dtype_of(self, name: str) -> str:
        """The stored dtype as safetensors names it (``BF16``, ``F8_E4M3``...), without reading the data."""
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.folder / file), framework="pt")
        return str(self._handles[file].get_slice(name).get_dtype())  # type: ignore[attr-defined]

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The stored shape, without reading the data."""
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.folder / file), framework="pt")
        return tuple(self._handles[file].get_slice(name).get_shape())  # type: ignore[attr-defined]

    def release(self, file: str) -> None:
        """Drop the handle (and its memory map) of a shard that is done."""
        self._handles.pop(file, None)

    def iter_shards(self) -> Iterator[tuple[str, list[str]]]:
        """(file, names) per shard; the caller reads names with ``get`` and the shard is released after."""
        for file in self.files:
            yield file, self.names_in(file)
            self.release(file)


class ShardWriter:
    """Collects tensors and writes a shard whenever the next tensor would pass ``max_shard_bytes``."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int | str = "5GB"):
        self.out_dir = Path(out_dir)
        if (self.out_dir / INDEX_NAME).exists() or any(self.out_dir.glob("*.safetensors")):
            raise ValueError(
                f"output folder {self.out_dir} already holds a checkpoint; choose a new or empty folder"
            )
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = parse_size(max_shard_bytes)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[list[str]] = []  # names per shard
        self.total_size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in s for s in self._written):
            raise ValueError(f"tensor {name!r} written twice")
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous()
        self._pending_bytes += size
        self.total_size += size

    def _flush(self) -> None:
        save_file(
            self._pending,
            str(self.out_dir / f"shard-{len(self._written):05d}.tmp"),
            metadata={"format": "pt"},
        )
        default_permissions(self.out_dir / f"shard-{len(self._written):05d}.tmp")  # save_file writes 0600
        self._written.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> dict:
        """Write the last shard, give shards their final names, write and return the index.

        One shard is ``model.safetensors`` (the name ``save_pretrained`` gives it), more are
        ``model-0000i-of-0000n.safetensors``; the index is written either way.
        """
        if self._pending or not self._written:
            self._flush()
        n = len(self._written)
        weight_map = {}
        for i, names in enumerate(self._written):
            final = _SINGLE_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out_dir / f"shard-{i:05d}.tmp").replace(self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return index
