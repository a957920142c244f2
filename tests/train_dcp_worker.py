"""Run under torchrun by test_train_dcp_fsdp.py: FSDP2 training with sharded (DCP) checkpoints, killed
and resumed, in one launch.

The worker joins the process group itself (``train`` keeps a group it did not create), then: a run of
6 steps that dies in step 3 (checkpoint at step 2); a second ``train`` with a fresh model (other init)
and a fresh source resumes from that checkpoint and finishes (async checkpoints at 4 and 6, HF export
streamed from the step-6 shards). The first run saves synchronously: an async save still unfinalized
when a run dies is lost by design (the previous checkpoint is used), which would make the test racy. Usage: torchrun --nproc_per_node 2 train_dcp_worker.py OUT_DIR
"""

from __future__ import annotations

import faulthandler
import sys

import torch

from conftest import make_tiny_model
from infir2.harness.distributed import init_distributed
from infir2.train import train
from train_fsdp_worker import SOURCE
from train_synthetic import CrashAfter, SyntheticSource, tiny_run_config

TRAIN = {"max_steps": 6, "save_every": 2, "keep_last": 2, "checkpoint_format": "dcp", "async_save": True}


def main(out_dir: str) -> None:
    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows its stack instead of a silent timeout
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    try:
        cfg = tiny_run_config(out_dir, "dcp", train={**TRAIN, "async_save": False})
        crashing = CrashAfter(2, rank=env.rank, world_size=env.world_size, **SOURCE)
        try:
            train(cfg, model=make_tiny_model(), train_source=crashing, progress=False)
            raise AssertionError("the run should have died in step 3")
        except KeyboardInterrupt:
            pass
        cfg = tiny_run_config(out_dir, "dcp", train=TRAIN)
        source = SyntheticSource(rank=env.rank, world_size=env.world_size, **SOURCE)
        result = train(cfg, model=make_tiny_model(seed=7), train_source=source, progress=False)
        assert result.resumed_from is not None and result.resumed_from.name == "step_00000002", result
    finally:
        env.close()


if __name__ == "__main__":
    main(sys.argv[1])
