"""Run configs of every stage without reading source: every key with its default and meaning, the shipped
configs, and a whole config checked the way its stage checks it before it builds anything.

A config's stage is read from its sections: one with a ``rollout`` or ``algo`` section is an RL config
(`infir2 rl`), one with a ``generation``, ``benchmark``, ``sampling``, ``server`` or ``loss`` section an eval config (`infir2 eval`:
its keys are eval's flags, checked by the same rules), any other a training config (`infir2 train`: CPT
or SFT). Both stages share the run, model,
fp8 and optim sections; a key left out takes its default. `infir2 train NAME` and `infir2 rl NAME` accept
a file or the name of a shipped config (`infir2 config --list`), after `pip install` as in a checkout.

examples:
  infir2 config --keys                                  # every key of both stages: default and meaning
  infir2 config --keys --stage rl                       # the RL keys only
  infir2 config --list                                  # the shipped configs, with their stage
  infir2 config tiny-cpt --set optim.lr=1e-3            # check it (paths, data, batch sizes), print it resolved
  infir2 config qwen2.5-7b-rl                           # an RL config, checked and resolved
  infir2 config qwen2.5-7b-cpt > my-7b.yaml             # a shipped config as a starting point, every key written
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = ["RL_SECTIONS", "add_arguments", "run", "stage_of"]

#: sections only an RL config has: a config with one of them is checked as `infir2 rl` checks it
RL_SECTIONS = ("rollout", "algo")
STAGES = {
    "train": "infir2 train (CPT, SFT)",
    "rl": "infir2 rl (GRPO / DAPO)",
    "eval": "infir2 eval (each key is a flag: `infir2 eval --help`)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..harness.run import add_set_argument

    parser.add_argument(
        "config",
        nargs="?",
        help="a YAML run config or a shipped config's name, of any stage (checked, printed)",
    )
    add_set_argument(parser)
    parser.add_argument("--keys", action="store_true", help="print every key with its default and meaning")
    parser.add_argument(
        "--stage", choices=sorted(STAGES), default=None, help="with --keys: one stage's keys (default: both)"
    )
    parser.add_argument("--list", action="store_true", help="list the shipped configs and their stages")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="processes a training run will use, for the batch-size check of a training config "
        "(default: $WORLD_SIZE or 1)",
    )


def stage_of(data: Any) -> str:
    """``"rl"`` for a config mapping with an RL section, ``"eval"`` with an eval section
    (``eval.config.EVAL_SECTIONS``), else ``"train"``."""
    from ..eval.config import EVAL_SECTIONS

    if isinstance(data, dict) and any(name in data for name in RL_SECTIONS):
        return "rl"
    return "eval" if isinstance(data, dict) and any(name in data for name in EVAL_SECTIONS) else "train"


def _default_config(stage: str) -> Any:
    if stage == "eval":
        from ..eval.config import EvalConfig

        return EvalConfig()
    if stage == "rl":
        from ..rl.config import RLConfig

        return RLConfig()
    from ..train.config import RunConfig

    return RunConfig()


def _print_keys(stage: str) -> None:
    from ..harness.config import key_reference

    print(f"# {STAGES[stage]}")
    section = None
    for key, default, meaning in key_reference(_default_config(stage)):
        if key.split(".")[0] != section:
            section = key.split(".")[0]
            print(f"{section}:")
        _print_key(key.split(".", 1)[1], default, meaning)
    if stage != "train":
        _print_engine_keys(stage)


def _print_key(key: str, default: Any, meaning: str) -> None:
    value = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
    print(f"  {key}: {value}")
    print(f"      {meaning}")


def _print_engine_keys(stage: str) -> None:
    """The ``engine`` section of each engine the stage can run (RL: those that roll out): its settings'
    fields (``generation.knob``)."""
    from dataclasses import MISSING

    from ..eval.config import eval_engines
    from ..rl.config import rollout_engines

    engines = rollout_engines() if stage == "rl" else eval_engines()
    key = "rollout.engine" if stage == "rl" else "generation.engine"
    for name, fields in engines.items():
        print(f"engine:  # with {key}: {name}")
        for f in fields:
            _print_key(f.name, None if f.default is MISSING else f.default, f.metadata["help"])


def _print_list() -> None:
    from ..harness.config import shipped_configs
    from ..harness.typed_yaml import load_yaml_file

    for name, path in shipped_configs().items():
        first = next(
            (line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#")), ""
        )
        print(f"{name:28s} {stage_of(load_yaml_file(path)):5s} {first}")


def _check(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The config at ``path`` checked as its stage checks it, as a resolved mapping."""
    from ..harness.config import config_to_dict
    from ..harness.typed_yaml import load_yaml_file

    stage = stage_of(load_yaml_file(path))
    if stage == "eval":
        from ..eval.builder import load_eval_config
        from ..harness.typed_yaml import to_plain

        if args.world_size is not None:
            raise ValueError(f"--world-size checks a training config's batch split; {path} is an eval config")
        return to_plain(load_eval_config(path, args.overrides))
    if stage == "rl":
        from ..rl.config import load_rl_config

        if args.world_size is not None:  # it would be ignored: an RL config has no batch split to check
            raise ValueError(f"--world-size checks a training config's batch split; {path} is an RL config")
        return config_to_dict(load_rl_config(path, args.overrides))
    from ..train.config import load_config
    from ..train.setup import check_inputs

    cfg = load_config(path, args.overrides)
    check_inputs(
        cfg, args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    )
    return config_to_dict(cfg)


def run(args: argparse.Namespace) -> int:
    from ..harness.config import resolve_config_path

    if args.config is None:  # --keys, --list, or (neither) both
        if args.overrides or args.world_size is not None:  # they check a config: refused, not ignored
            flag = "--set" if args.overrides else "--world-size"
            raise ValueError(f"{flag} goes with a config to check (infir2 config CONFIG {flag} ...)")
        if args.keys or not args.list:
            for stage in [args.stage] if args.stage else list(STAGES):
                _print_keys(stage)
        if args.list or not args.keys:
            print(
                "\nshipped configs (infir2 train NAME / infir2 rl NAME):"
                if not args.list
                else "shipped configs:"
            )
            _print_list()
        return 0
    if args.keys or args.list:
        raise ValueError("give a config to check, or --keys / --list, not both")
    if args.stage is not None:
        raise ValueError("--stage goes with --keys; a config's stage is read from its sections")
    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"--world-size: must be >= 1, got {args.world_size}")
    sys.stdout.write(yaml.safe_dump(_check(resolve_config_path(args.config), args), sort_keys=False))
    return 0
