"""Run under torchrun by test_train_two_processes_exact.py: 4 steps of a tiny run per recipe on 2 ranks.

Each rank runs one of the step's two micro-batches (one process runs both, in the same order), gradient
clipping is active on every step, and every recipe's run folder is written under OUT_DIR/two-<recipe>.
Usage: torchrun --standalone --nproc_per_node 2 two_process_exact_worker.py OUT_DIR RECIPE [RECIPE ...]
"""

from __future__ import annotations

import faulthandler
import sys

import torch
import torch.distributed as dist

from conftest import make_tiny_model
from infir2.train import train
from train_synthetic import SyntheticSource, tiny_run_config

#: two micro-batches a step: one per rank, or both in one process (the same sum of gradients either way)
SOURCE = {"seed": 3, "global_batch_size": 4, "micro_batch_size": 2}
#: grad_clip far below the norm (~3): every step is clipped by the float64 norm
CONFIG = {"optim": {"grad_clip": 0.05}, "train": {"max_steps": 4, "checkpoint_format": "full"}}


def run_config(out_dir: str, recipe: str):
    return tiny_run_config(out_dir, f"two-{recipe}", fp8={"recipe": recipe}, **CONFIG)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(240, exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # train() keeps a group it finds: one group for every recipe's run
    rank, world = dist.get_rank(), dist.get_world_size()
    for recipe in sys.argv[2:]:
        source = SyntheticSource(rank=rank, world_size=world, **SOURCE)
        train(run_config(sys.argv[1], recipe), model=make_tiny_model(), train_source=source, progress=False)
    dist.destroy_process_group()
