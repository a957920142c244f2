"""Run under torchrun by test_train_two_processes_exact.py: 4 steps of a tiny run per recipe on 2 ranks.

Each rank runs one of the step's two micro-batches (one process runs both, in the same order), gradient
clipping is active on every step, and every recipe's run folder is written under OUT_DIR/two-<recipe>.
Usage: torchrun --standalone --nproc_per_node 2 two_process_exact_worker.py OUT_DIR RECIPE [RECIPE ...]
(``benchmarks/two_processes_at_width.py`` runs it at the Qwen2.5-0.5B width: ``--width 896 --layers 2``.)
"""

from __future__ import annotations

import faulthandler
import sys

import torch
import torch.distributed as dist

from conftest import make_tiny_model
from infir2.train import train
from train_synthetic import SyntheticSource, end_process_group, tiny_run_config

#: two micro-batches a step: one per rank, or both in one process (the same sum of gradients either way)
SOURCE = {"seed": 3, "global_batch_size": 4, "micro_batch_size": 2}
#: grad_clip far below the norm (~3): every step is clipped by the float64 norm
CONFIG = {"optim": {"grad_clip": 0.05}, "train": {"max_steps": 4, "checkpoint_format": "full"}}


#: runs named ``RECIPE@VARIANT``: the recipe with these keys more (FP8 AdamW moments; in sharded checkpoints)
VARIANTS: dict[str, dict[str, dict]] = {
    "fp8_moments": {"optim": {"state_dtype": "fp8"}},
    "fp8_moments_dcp": {
        "optim": {"state_dtype": "fp8"},
        "train": {"checkpoint_format": "dcp", "save_every": 2},
    },
}


def run_config(out_dir: str, recipe: str, steps: int = 4):
    """The run of ``recipe`` (``RECIPE@VARIANT``: with the keys of ``VARIANTS[VARIANT]``)."""
    name, _, variant = recipe.partition("@")
    more = VARIANTS.get(variant, {})
    optim = {**CONFIG["optim"], **more.get("optim", {})}
    train = {**CONFIG["train"], **more.get("train", {}), "max_steps": steps}
    return tiny_run_config(out_dir, f"two-{recipe}", fp8={"recipe": name}, optim=optim, train=train)


def model(width: int | None = None, layers: int = 2) -> torch.nn.Module:
    """The tests' tiny model, or one of ``width`` with Qwen2.5-0.5B's proportions (896: 14 / 2 heads, MLP 4864)."""
    if width is None:
        return make_tiny_model()
    shape = {"hidden": width, "layers": layers, "heads": width // 64, "kv_heads": 2}
    return make_tiny_model(vocab_size=4096, intermediate=width * 38 // 7, **shape)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(1800, exit=True)
    torch.set_num_threads(1)
    args = sys.argv[1:]
    width = int(args[args.index("--width") + 1]) if "--width" in args else None
    layers = int(args[args.index("--layers") + 1]) if "--layers" in args else 2
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 4
    recipes = [a for a in args[1:] if not a.startswith("--") and not a.isdigit()]
    dist.init_process_group("gloo")  # train() keeps a group it finds: one group for every recipe's run
    rank, world = dist.get_rank(), dist.get_world_size()
    for recipe in recipes:
        source = SyntheticSource(rank=rank, world_size=world, vocab_size=4096 if width else 300, **SOURCE)
        cfg = run_config(args[0], recipe, steps)
        train(cfg, model=model(width, layers), train_source=source, progress=False)
    end_process_group(rank)
