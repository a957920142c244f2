"""Run under torchrun by test_train_fsdp.py: FSDP2 training of a tiny model, killed and resumed.

``crash``: train 2 of 4 steps (checkpoint at step 2), then die. ``resume``: fresh processes, fresh
objects; ``train`` resumes from that checkpoint and finishes. ``train`` joins the torchrun process
group itself (as ``infir2 train`` does). Usage:
torchrun --nproc_per_node 2 train_fsdp_worker.py OUT_DIR crash|resume
"""

from __future__ import annotations

import faulthandler
import os
import sys

import torch

from conftest import make_tiny_model
from infir2.train import train
from train_synthetic import CrashAfter, SyntheticSource, tiny_run_config

SOURCE = {"seed": 1, "global_batch_size": 8, "micro_batch_size": 2}
CONFIG = {"train": {"max_steps": 4, "save_every": 2, "checkpoint_format": "full"}}  # auto would pick dcp


def main(out_dir: str, phase: str) -> None:
    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows its stack instead of a silent timeout
    torch.set_num_threads(1)
    cfg = tiny_run_config(out_dir, "fsdp", **CONFIG)
    # the source needs its rank before train() joins the group: take it from torchrun's environment
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if phase == "crash":
        try:
            train(
                cfg,
                model=make_tiny_model(),
                train_source=CrashAfter(2, rank=rank, world_size=world, **SOURCE),
                progress=False,
            )
        except KeyboardInterrupt:
            return
        raise AssertionError("the run should have died at step 3")
    source = SyntheticSource(rank=rank, world_size=world, **SOURCE)
    result = train(cfg, model=make_tiny_model(seed=7), train_source=source, progress=False)
    assert result.resumed_from is not None and result.resumed_from.name == "step_00000002", (
        result.resumed_from
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
