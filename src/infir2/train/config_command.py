"""Run configs without reading source: every key with its default and meaning, the shipped configs, and a
whole config checked the way `infir2 train` checks it before it builds anything.

A run config is a YAML file of eight sections (run, model, fp8, data, optim, schedule, train, load);
a key left out takes its default. `infir2 train NAME` accepts a file or the name of a shipped config
(`infir2 config --list`), so `infir2 train tiny-cpt` works after `pip install` as in a checkout.

examples:
  infir2 config --keys                                  # every key: default and meaning
  infir2 config --list                                  # the shipped configs
  infir2 config tiny-cpt --set optim.lr=1e-3            # check it (paths, data, batch sizes), print it resolved
  infir2 config qwen2.5-7b-cpt > my-7b.yaml             # a shipped config as a starting point, every key written
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..harness.run import add_set_argument

    parser.add_argument(
        "config", nargs="?", help="a YAML run config or a shipped config's name (checked, printed)"
    )
    add_set_argument(parser)
    parser.add_argument("--keys", action="store_true", help="print every key with its default and meaning")
    parser.add_argument("--list", action="store_true", help="list the shipped configs")
    parser.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="processes the run will use, for the batch-size check (default: $WORLD_SIZE or 1)",
    )


def _print_keys() -> None:
    from .config import key_reference

    section = None
    for key, default, meaning in key_reference():
        if key.split(".")[0] != section:
            section = key.split(".")[0]
            print(f"{section}:")
        print(
            f"  {key.split('.', 1)[1]}: {yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}"
        )
        print(f"      {meaning}")


def _print_list() -> None:
    from .config import shipped_configs

    for name, path in shipped_configs().items():
        first = next(
            (line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#")), ""
        )
        print(f"{name:28s} {first}")


def run(args: argparse.Namespace) -> int:
    from .config import config_to_dict, load_config
    from .setup import check_inputs

    if args.config is None:  # --keys, --list, or (neither) both
        if args.keys or not args.list:
            _print_keys()
        if args.list or not args.keys:
            print("\nshipped configs (infir2 train NAME):" if not args.list else "shipped configs:")
            _print_list()
        return 0
    if args.keys or args.list:
        raise ValueError("give a config to check, or --keys / --list, not both")
    if args.world_size < 1:
        raise ValueError(f"--world-size: must be >= 1, got {args.world_size}")
    cfg = load_config(args.config, args.overrides)
    check_inputs(cfg, args.world_size)
    sys.stdout.write(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return 0
