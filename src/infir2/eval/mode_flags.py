"""`infir2 eval`'s flags of one mode checked before anything is read: the held-out loss's (--perplexity's
--split, --seq-len, --max-windows) and a benchmark's (--n, --greedy, --temperature ...), each refused in
the other mode, where it would be ignored; and --precision recipe's --recipe (one recipe with FP8)."""

from __future__ import annotations

import argparse
from typing import Any

from ..fp8 import get_recipe, recipe_names
from .config import EvalLoss, defaults

__all__ = ["BENCHMARK_FLAGS", "LOSS_FLAGS", "check_mode_flags", "check_recipe"]

#: the held-out loss's flags (dest -> default) and the benchmark's: each refused in the other mode
LOSS_FLAGS: dict[str, Any] = defaults(EvalLoss, ("split", "seq_len", "max_windows"))
BENCHMARK_FLAGS: tuple[str, ...] = (
    "preset",
    "tokenizer",
    "task",
    "data",
    "n",
    "greedy",
    "temperature",
    "top_p",
    "max_new_tokens",
    "limit",
    "beyond_context",
    "system_prompt",
    "no_system_prompt",
    "think_prefix",
    "no_think_prefix",
)


def check_mode_flags(args: argparse.Namespace) -> None:
    """A flag of the held-out loss without --perplexity, or a benchmark's flag with it, is refused (it
    would be ignored); then the loss flags' defaults are filled."""
    if args.perplexity:
        wrong, why = BENCHMARK_FLAGS, "sets how a benchmark is run, not the held-out loss of --perplexity"
    else:
        wrong, why = tuple(LOSS_FLAGS), "sets the held-out loss of --perplexity TOKEN_DIR: give that too"
    given = [d for d in wrong if getattr(args, d) is not None and getattr(args, d) is not False]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} {why}")
    for dest, default in LOSS_FLAGS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)


def check_recipe(args: argparse.Namespace) -> None:
    """--precision recipe's --recipe, before anything is read: one recipe name (the model runs one), one
    with FP8 layers (a recipe without is --precision high)."""
    if args.precision != "recipe":
        return
    names = recipe_names(args.recipe, "--recipe")  # each a known recipe name
    if len(names) > 1:
        raise ValueError(
            f"--recipe takes one recipe, got {len(names)} ({args.recipe}): run eval once per recipe, each "
            "with its own --out"
        )
    name = names[0]
    if not get_recipe(name).enabled:
        raise ValueError(
            f"--recipe {name} has no FP8 layers: for the model's own precision use --precision high"
        )
