"""The context-parallel tests' shared case: packed rows of odd-length documents, a tiny FP8 model, and one
forward + backward that records what every FP8 linear was given.

Documents are arithmetic progressions ``x_t = (a + b t) mod V`` of odd lengths (3 .. 611 tokens), packed
end to end into rows of ``WIDTH`` tokens (``data.context.pack_documents``: ``position_ids`` restart at
each document, the row's tail is padding). Their boundaries fall anywhere, shard edges included. A
step's rows are split over data ranks in contiguous blocks, one row per micro-batch, so one process sees
exactly the rows that the data ranks see together.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conftest import make_tiny_model
from infir2.data.base import IGNORE_INDEX, MicroBatch, count_loss_tokens
from infir2.data.context import pack_documents, shard_micro_batch
from infir2.fp8 import get_recipe
from infir2.fp8.quantize import quantize
from infir2.loss import shard_context, token_ce_sum
from infir2.model import prepare_for_training
from infir2.nn import Fp8Linear

WIDTH = 1024  # tokens per row: 4 shards of 256 (2 tiles of 128) at context 4
VOCAB = 300
ROWS = 2  # rows a step, all data ranks together


def documents(seed: int, total: int) -> list[tuple[list[int], list[int]]]:
    """Odd-length documents of about ``total`` tokens; the first third of each is a prompt (no loss)."""
    g = torch.Generator().manual_seed(seed)
    docs, used = [], 0
    while used < total:
        n = int(torch.randint(1, 306, (1,), generator=g)) * 2 + 1  # 3 .. 611, odd
        a, b = (int(v) for v in torch.randint(0, VOCAB, (2,), generator=g))
        ids = [(a + (b % 7 + 1) * t) % VOCAB for t in range(n)]
        labels = [IGNORE_INDEX if t < n // 3 else i for t, i in enumerate(ids)]
        docs.append((ids, labels))
        used += n
    return docs


def packed_rows(step: int, rows: int = ROWS, seed: int = 0) -> list[MicroBatch]:
    """``rows`` packed rows of ``WIDTH`` tokens for ``step`` (documents of odd lengths, some padding)."""
    docs = documents(seed * 1_000_003 + step, rows * WIDTH)
    packed = pack_documents(docs, WIDTH)
    assert len(packed) >= rows, "documents for fewer rows than asked"
    return packed[:rows]


class PackedSource:
    """A ``StepSource`` of ``packed_rows``: data rank ``rank`` of ``world_size`` gets its contiguous rows."""

    def __init__(self, rank: int = 0, world_size: int = 1, rows: int = ROWS, seed: int = 0) -> None:
        assert rows % world_size == 0
        self.rank, self.world_size, self.rows, self.seed, self.step = rank, world_size, rows, seed, 0

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        while True:
            batch = packed_rows(self.step, self.rows, self.seed)
            self.step += 1
            per = self.rows // self.world_size
            yield batch[self.rank * per : (self.rank + 1) * per]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


def tiny() -> nn.Module:
    """The tiny Qwen2 (hidden 128, 2 layers, 4 heads, 2 KV heads), as ``train`` takes it."""
    return make_tiny_model(max_positions=2 * WIDTH)


def model(recipe: str = "blockwise", checkpointing: bool = False) -> nn.Module:
    """``tiny()`` with FP8 ``recipe`` and fp32 masters (and per-layer activation checkpointing), as a
    training run makes it."""
    return prepare_for_training(tiny(), get_recipe(recipe), None, checkpointing, True, torch.float32)


def record_inputs(net: nn.Module) -> tuple[dict[str, list[torch.Tensor]], list[Any]]:
    """``inputs[name]``: what every FP8 linear was given, call by call (and the hook handles)."""
    inputs: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in net.named_modules():
        if isinstance(module, Fp8Linear):
            store = inputs.setdefault(name, [])
            handles.append(
                module.register_forward_pre_hook(lambda _m, args, s=store: s.append(args[0].detach()))
            )
    return inputs, handles


def forward_backward(net: nn.Module, micro_batches: list[MicroBatch], scale: float) -> float:
    """The training step's forward + backward (``train.loop.train_step``) with a given loss scale; the
    summed CE of these micro-batches."""
    total = 0.0
    for mb in micro_batches:
        with shard_context(mb):
            ce = token_ce_sum(net, mb, "fp32", torch.device("cpu"), 0)
            (ce * scale).backward()
        total += float(ce.detach())
    return total


def one_process(recipe: str = "blockwise", step: int = 0) -> dict[str, Any]:
    """The unsharded reference: every row of the step in one process (context degree 1 of the same
    path), gradients of the per-token mean."""
    from infir2.nn.context_parallel import enable_context_parallel

    net = enable_context_parallel(model(recipe), None)
    shards = [shard_micro_batch(mb, 0, 1) for mb in packed_rows(step)]
    n = count_loss_tokens(shards)
    inputs, handles = record_inputs(net)
    start = time.perf_counter()
    ce = forward_backward(net, shards, 1.0 / n)
    seconds = time.perf_counter() - start
    for h in handles:
        h.remove()
    grads = {name: p.grad.clone() for name, p in net.named_parameters()}
    return {"inputs": inputs, "ce": ce, "n": n, "grads": grads, "seconds": seconds}


def fp8_codes(x: torch.Tensor, cast: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, L, K]`` quantized as a linear's input is (rows flattened): codes and scales, per row of
    ``x`` (``[B, L, K]`` uint8, ``[B, L / tile rows, ...]``)."""
    rows, length, width = x.shape
    data, scale_inv = quantize(x.reshape(-1, width), cast.block, cast.fmt, cast.scale_encoding)
    return data.view(torch.uint8).view(rows, length, width), scale_inv.view(rows, length // cast.block[0], -1)


def same_codes_as_one_process(full: torch.Tensor, shard: torch.Tensor, start: int) -> bool:
    """The FP8 codes and scales this rank makes of its shard (both activation casts: the 1x128 fprop
    tiles and the 128x1 wgrad tiles) are those of the same rows of the whole sequence in one process."""
    recipe = get_recipe("blockwise")
    for cast in (recipe.x, recipe.x_wgrad):
        (a, sa), (b, sb) = fp8_codes(full, cast), fp8_codes(shard, cast)
        tile = cast.block[0]
        rows = slice(start, start + shard.shape[1])
        if not (torch.equal(a[:, rows], b) and torch.equal(sa[:, start // tile : rows.stop // tile], sb)):
            return False
    return True


def load_ranks(folder: Path) -> list[dict[str, Any]]:
    return [
        torch.load(p, weights_only=False)
        for p in sorted(folder.glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    ]


def compare(ref: dict[str, Any], ranks: list[dict[str, Any]], data: int) -> dict[str, Any]:
    """Asserts every FP8 linear's input of every rank, and the FP8 codes and scales the rank makes of it
    (1x128 and 128x1 tiles), is the one process's rows, bit for bit; returns the loss's relative error and the gradients' (max |diff| / max |g| per
    parameter: the worst, its name, the worst of the last layer's MLP and lm_head)."""
    per = len(packed_rows(0)) // data
    for name, calls in ref["inputs"].items():
        for i, full in enumerate(calls):  # call i: row i of the step (one row per micro-batch)
            replica, j = divmod(i, per)
            shards = sorted((r for r in ranks if r["layout"][0] == replica), key=lambda r: r["layout"][1])
            repeats = len(shards[0]["inputs"][name]) // per  # 2 under activation checkpointing: the recompute
            for call in range(j * repeats, (j + 1) * repeats):
                got = torch.cat([r["inputs"][name][call] for r in shards], dim=1)  # shards side by side
                assert torch.equal(got, full), (name, i, call)
                size = full.shape[1] // len(shards)
                for c, r in enumerate(shards):  # each rank quantizes its own shard
                    assert same_codes_as_one_process(full, r["inputs"][name][call], c * size), (name, i, c)
    ce = sum(r["ce"] for r in ranks)
    assert ranks[0]["n"] == ref["n"]
    loss_err = abs(ce / ref["n"] - ref["ce"] / ref["n"]) / (ref["ce"] / ref["n"])
    grads = ranks[0]["grads"]
    errs = {name: float((grads[name] - g).abs().max() / g.abs().max()) for name, g in ref["grads"].items()}
    worst = max(errs, key=errs.__getitem__)
    last = max(v for k, v in errs.items() if "layers.1.mlp" in k or "lm_head" in k)
    return {"loss": loss_err, "grad": errs[worst], "worst": worst, "last_layer": last}
