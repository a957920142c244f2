"""Reinforcement learning on verifiable math (GRPO / DAPO) with FP8 rollouts, from a YAML run config.

The config names the policy (typically the SFT run's <run>/hf), the prompts (JSONL with "problem" and
"answer" per line, the format `infir2 eval --task math` reads), the reward (the math grader: the last
\\boxed{} after </think>, checked with math-verify), the rollout engine and its precision (fp8: the
weights quantized 128x128 by the FP8 export's own function, activations 1x128), the training FP8
recipe, and the algorithm's knobs (group size, clip-higher 0.2 / 0.28, dynamic sampling, overlong
masking, truncated importance sampling); docs/RL.md explains each and the mismatch metrics logged
every step. The run folder <run.out_dir>/<run.name> gets config.yaml, metrics.jsonl, tensorboard/,
checkpoints/ and, at the end, hf/. Re-running the same command resumes from the newest checkpoint
and continues bit for bit (prompt order, sampler, dynamic-sampling buffer included); a rerun whose
config changes the run (optim, data, model, fp8, rollout, algo, run.seed) is refused unless given
--accept-config-changes.

Under torchrun every process runs the loop: the policy is sharded with FSDP2, each process generates
its share of every round's prompts, and the groups are gathered so that the run trains on what one
process would (docs/RL.md, "Several processes").

CONFIG is a YAML file or the name of a shipped RL config (`infir2 config --list`); `infir2 config --keys
--stage rl` prints every key with its default and meaning.

examples:
  infir2 rl my-rl.yaml
  infir2 config qwen2.5-7b-rl > my-rl.yaml    # the authors' 7B settings as a starting point
  torchrun --standalone --nproc_per_node 2 -m infir2.cli rl my-rl.yaml
  infir2 rl my-rl.yaml --set rollout.precision=high --set fp8.recipe=bf16 --set run.name=bf16-pair
  infir2 rl my-rl.yaml --set rollout.group_size=8 --set algo.tis=mask
"""

from __future__ import annotations

import argparse
import logging

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..harness.run import add_run_arguments

    parser.add_argument(
        "config", help="YAML RL run config, or a shipped config's name (infir2 config --list)"
    )
    add_run_arguments(parser, "optim, data, model, fp8, rollout, algo, run.seed")


def run(args: argparse.Namespace) -> int:
    from ..harness.run import log_outputs, run_overrides
    from .config import load_rl_config
    from .loop import rl

    cfg = load_rl_config(args.config, run_overrides(args))
    result = rl(cfg, progress=not args.no_progress)
    last = result.history[-1] if result.history else {}
    if "val_accuracy" in last:
        log.info("done: step %d, held-out accuracy %.3f", result.step, last["val_accuracy"])
    log_outputs(result)
    return 0
