"""Train a causal LM (continual pre-training or SFT) in FP8 or BF16 from a YAML run config.

The config names the model (a local Hugging Face folder, or a new one from_config), the FP8 recipe,
the data (CPT token shards from `infir2 prepare-cpt`, or SFT chat JSONL), AdamW, the schedule (WSD
or cosine) and the loop settings. CONFIG is a YAML file or the name of a shipped config (the InfiR2
setups and tiny CPU runs: `infir2 config --list`); `infir2 config --keys` prints every key with its
default and meaning, and the whole config (paths, data, batch sizes) is checked before any model is
built. The run folder <run.out_dir>/<run.name> gets config.yaml (resolved), metrics.jsonl, tensorboard/, checkpoints/ and,
at the end, hf/ (a Hugging Face folder that transformers loads).

Re-running the same command resumes from the latest checkpoint in the run folder and continues
exactly where it stopped (same losses step by step). `--load PATH` starts from PATH instead, every
time it is given: drop it to resume the new run. Each checkpoint's SHA-256 is checked on load: a
damaged one is skipped (with a warning) for the next older one; if none loads, the command refuses
to start over them unless given --start-fresh. A rerun whose config changes the run's meaning
(schedule, optim, data, model, fp8, run.seed, train.max_steps) is refused with the list of changes
unless given --accept-config-changes (the old config.yaml is kept as config.<step>.yaml). One run folder takes one training at a time (a lock
file, <run>/.lock, names the process holding it). Several processes (torchrun) shard the model with
FSDP2; the run folder must be on a filesystem all nodes see.

Checkpoints (train.checkpoint_format): the default, auto, writes DCP shards (torch.distributed.checkpoint:
every rank writes its own part, nothing is gathered to rank 0; with train.async_save the loop does not
wait for the disk) whenever the run has several processes, and one full state.pt (a plain torch.load
reads it) for a single process; set full or dcp to choose. Both load on any number of processes;
an exact data resume needs the same number (docs/DISTRIBUTED.md).

examples:
  infir2 train qwen2.5-1.5b-cpt
  infir2 train my.yaml --set optim.lr=3e-4 --set fp8.recipe=bf16 --set run.name=bf16-baseline
  infir2 train my.yaml --load runs/qwen2.5-1.5b-cpt/checkpoints/step_00035000         # start from that checkpoint
  infir2 train qwen2.5-7b-decay-only              # WSD decay from a stable ckpt
  torchrun --nproc_per_node 8 -m infir2.cli train qwen2.5-7b-sft-stage1
                                                   # data parallel, FSDP2 (NCCL on GPUs, gloo on CPUs)
  torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
      -m infir2.cli train qwen2.5-7b-cpt
"""

from __future__ import annotations

import argparse
import logging

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..harness.run import add_run_arguments

    parser.add_argument("config", help="YAML run config, or a shipped config's name (infir2 config --list)")
    parser.add_argument(
        "--load",
        metavar="PATH",
        help="start from this checkpoint folder even if the run folder has its own "
        "(sets load.path and load.force; load.mode stays as configured)",
    )
    parser.add_argument(
        "--start-fresh",
        action="store_true",
        help="if the run folder has checkpoints but none loads (damaged), set them aside "
        "as damaged-step_* and start from step 0 instead of refusing",
    )
    add_run_arguments(parser, "schedule, optim, data, model, fp8, run.seed, train.max_steps")


def run(args: argparse.Namespace) -> int:
    from ..harness.run import log_outputs, run_overrides
    from .config import load_config
    from .loop import train

    overrides = run_overrides(args)
    if args.load:
        overrides += [f"load.path={args.load}", "load.force=true"]
    if args.start_fresh:
        overrides.append("load.start_fresh=true")
    cfg = load_config(args.config, overrides)
    result = train(cfg, progress=not args.no_progress)
    if result.history:
        log.info(
            "done: step %d, final loss %.4f%s",
            result.step,
            result.final_loss or float("nan"),
            f", val loss {result.final_val_loss:.4f}" if result.final_val_loss is not None else "",
        )
    log_outputs(result)
    return 0
