"""Run under torchrun by test_sharded_checkpoint.py: 2-rank FSDP2 training, a sharded save, a reload.

Trains the tiny Qwen2 of fsdp_param_gather_worker (FP8 all-gather on) for 2 steps, saves a sharded
checkpoint (async when asked), and writes rank 0's full state (gathered the old way, as reference) to
OUT_DIR/full.pt; then builds a fresh sharded model, loads the checkpoint on the same 2 ranks and checks
model and optimizer states against the reference. Usage:
torchrun --nproc_per_node 2 sharded_checkpoint_worker.py OUT_DIR sync|async
"""

from __future__ import annotations

import faulthandler
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from fsdp_param_gather_worker import SOURCE, tiny_qwen2
from infir2.checkpoint import load_sharded, save_sharded
from infir2.harness.distributed import init_distributed, shard_model
from infir2.harness.optim import build_optimizer
from infir2.model import prepare_for_training
from infir2.train.config import OptimConfig
from infir2.train.loop import train_step
from train_synthetic import SyntheticSource


def build(env):
    model = shard_model(prepare_for_training(tiny_qwen2(seed=5), "blockwise"), "fp32", True)
    return model, build_optimizer(model, OptimConfig(lr=3e-3))


def full_state(model, optimizer):
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def main(out_dir: str, mode: str) -> None:
    faulthandler.dump_traceback_later(240, exit=True)
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    try:
        model, optimizer = build(env)
        source = SyntheticSource(rank=env.rank, world_size=env.world_size, **SOURCE)
        for _, micro_batches in zip(range(2), source, strict=False):
            train_step(model, optimizer, micro_batches, 3e-3, 1.0, "fp32", env)
        extra = {
            "scheduler": {"step": 2},
            "train_state": {"step": 2},
            "data": source.state_dict(),
            "rng": {"rank": env.rank},
        }
        pending = save_sharded(f"{out_dir}/ckpt", 2, model, optimizer, extra, env, async_save=mode == "async")
        path = pending.wait()
        ref_model, ref_optim = full_state(model, optimizer)
        if env.is_main:
            torch.save({"model": ref_model, "optimizer": ref_optim}, f"{out_dir}/full.pt")
        fresh, fresh_optim = build(env)
        loaded = load_sharded(path, fresh, fresh_optim, env)
        assert loaded["data"][env.rank] == {"step": 2} and loaded["rng"][1] == {"rank": 1}, loaded
        got_model, got_optim = full_state(fresh, fresh_optim)
        if env.is_main:
            for key, value in ref_model.items():
                assert torch.equal(got_model[key], value), key
            for name, moments in ref_optim["state"].items():
                for k, v in moments.items():
                    assert torch.equal(got_optim["state"][name][k], v), (name, k)
    finally:
        env.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
