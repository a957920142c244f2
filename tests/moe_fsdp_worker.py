"""Run under torchrun by test_moe_fsdp.py: a few FSDP2 steps of a tiny FP8 Qwen3-MoE (experts sharded on dim 0).

Writes the losses and the final full weights of rank 0 to OUT_DIR/<mode>.pt per MODE (``fp32``, or
``fp32-fp8gather``: the dense projections all-gathered as FP8 codes; the experts' 3-D weights are
all-gathered in high precision either way).
Usage: torchrun --nproc_per_node 2 moe_fsdp_worker.py OUT_DIR MODE [MODE ...]
"""

from __future__ import annotations

import faulthandler
import sys

import torch
import torch.distributed as dist

from infir2.model import prepare_for_training
from infir2.nn.moe import Fp8Experts
from infir2.train.config import OptimConfig
from infir2.train.distributed import init_distributed, shard_model
from infir2.train.loop import train_step
from infir2.train.optim import build_optimizer
from moe_models import make_tiny_moe
from train_synthetic import SyntheticSource

STEPS = 3
SOURCE = {"vocab_size": 256, "seed": 3, "global_batch_size": 4, "micro_batch_size": 1, "seq_len": 32}


def moe_model() -> torch.nn.Module:
    model = prepare_for_training(make_tiny_moe("qwen3_moe"), "blockwise")
    assert sum(isinstance(m, Fp8Experts) for m in model.modules()) == 2
    return model


def train_losses(model: torch.nn.Module, env, rank: int, world: int) -> list[float]:
    optimizer = build_optimizer(model, OptimConfig(lr=3e-3))
    source = SyntheticSource(rank=rank, world_size=world, **SOURCE)
    return [
        train_step(model, optimizer, batches, 3e-3, 1.0, "fp32", env)["loss"]
        for _, batches in zip(range(STEPS), source, strict=False)
    ]


def main(out_dir: str, modes: list[str]) -> None:
    faulthandler.dump_traceback_later(240, exit=True)
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    try:
        for mode in modes:
            model = moe_model()
            shard_model(model, "fp32", mode.endswith("fp8gather"))
            losses = train_losses(model, env, env.rank, env.world_size)
            full = {k: v.full_tensor() for k, v in model.state_dict().items()}
            if env.is_main:
                torch.save({"losses": losses, "weights": full}, f"{out_dir}/{mode}.pt")
        dist.barrier()
    finally:
        env.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
