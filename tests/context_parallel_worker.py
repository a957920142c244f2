"""Run under torchrun by test_context_parallel.py: one FP8 step of the packed case on a data x context grid.

``exact OUT CONTEXT [CONTEXT ...] [--recipe R]``: for each context degree (``2ac``: 2 with checkpointing) (the data degree is the world over it), the
model is sharded with FSDP2 over the whole world and its attention made context-parallel; each rank runs
its shards of its data replica's rows and writes ``OUT/d<D>c<C>/rank<r>.pt``: the inputs of every FP8 linear,
its CE sum, loss-token count and forward + backward seconds, and (rank 0) the full gradients
(``-<recipe>`` after the folder's name for a recipe other than blockwise, ``-ac`` with per-layer activation
checkpointing: its backward recomputes each layer, gathering the keys and values again). ``train OUT CONTEXT STEPS NAME
[--kill-after K] [--save-every S]``: ``infir2.train.train`` on ``PackedSource`` with ``parallel.context``,
the run folder ``OUT/NAME``; with ``--kill-after`` rank 0 SIGKILLs itself when step K+1 is asked for.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from context_parallel_case import PackedSource, forward_backward, model, packed_rows, record_inputs, tiny
from infir2.data.base import count_loss_tokens
from infir2.data.context import shard_micro_batch
from infir2.harness.distributed import all_reduce_sum, context_layout, init_distributed, shard_model
from infir2.nn.context_parallel import enable_context_parallel
from infir2.train import train
from train_synthetic import DiesAfter, end_process_group, tiny_run_config


def exact(out: Path, context: int, recipe: str = "blockwise", checkpointing: bool = False) -> None:
    env = init_distributed("cpu")
    layout = context_layout(env, context)
    net = shard_model(model(recipe, checkpointing), "fp32", recipe != "bf16")
    enable_context_parallel(net, layout.group)
    data = layout.data_env
    rows = packed_rows(0)
    per = len(rows) // data.world_size
    mine = [
        shard_micro_batch(mb, layout.context_rank, context)
        for mb in rows[data.rank * per : (data.rank + 1) * per]
    ]
    n = float(all_reduce_sum(torch.tensor([float(count_loss_tokens(mine))]), env))
    inputs, handles = record_inputs(net)
    start = time.perf_counter()
    ce = forward_backward(net, mine, env.world_size / n)  # FSDP2 averages over the world
    seconds = time.perf_counter() - start
    for h in handles:
        h.remove()
    grads = {name: p.grad.full_tensor() for name, p in net.named_parameters()}
    name = f"d{data.world_size}c{context}" + ("" if recipe == "blockwise" else f"-{recipe}")
    folder = out / (name + ("-ac" if checkpointing else ""))
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "inputs": inputs,
        "ce": ce,
        "n": n,
        "layout": (data.rank, layout.context_rank),
        "seconds": seconds,
    }
    if env.is_main:
        record["grads"] = grads
    torch.save(record, folder / f"rank{env.rank}.pt")
    dist.barrier()


class KillAfter(DiesAfter, PackedSource):
    """Rank 0 SIGKILLs itself (no cleanup, like ``kill -9``) when asked for step ``after`` + 1."""

    def die(self) -> None:
        if dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def run_config(out: str, name: str, context: int, steps: int, save_every: int = 0) -> Any:
    train_keys = {"max_steps": steps, "save_every": save_every, "checkpoint_format": "dcp", "keep_last": 1}
    return tiny_run_config(out, name, parallel={"context": context}, train=train_keys)


def train_run(out: str, context: int, steps: int, name: str, kill_after: int | None, save_every: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = {"rank": rank // context, "world_size": world // context}
    source = PackedSource(**data) if kill_after is None else KillAfter(kill_after, **data)
    cfg = run_config(out, name, context, steps, save_every)
    train(cfg, model=tiny(), train_source=source, progress=False)


def _flag(args: list[str], name: str) -> int | None:
    return int(args[args.index(name) + 1]) if name in args else None


if __name__ == "__main__":
    faulthandler.dump_traceback_later(600, exit=True)
    torch.set_num_threads(1)
    mode, out, *rest = sys.argv[1:]
    dist.init_process_group("gloo")
    if mode == "exact":
        recipe = rest[rest.index("--recipe") + 1] if "--recipe" in rest else "blockwise"
        for degree in (d for d in rest if d.removesuffix("ac").isdigit()):  # 2ac: with checkpointing
            exact(Path(out), int(degree.removesuffix("ac")), recipe, degree.endswith("ac"))
    else:
        context, steps, name = int(rest[0]), int(rest[1]), rest[2]
        train_run(out, context, steps, name, _flag(rest, "--kill-after"), _flag(rest, "--save-every") or 0)
    end_process_group(dist.get_rank())
