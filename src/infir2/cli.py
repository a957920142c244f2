"""The ``infir2`` command: the only place that reads argv and the environment.

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and ``run(args)``;
this file only builds the parser, sets up logging, and dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

__all__ = ["COMMANDS", "main"]

#: subcommand -> (module, one-line help). Modules are imported lazily: `infir2 --help` stays fast.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "infir2.demo.command",
        "the whole recipe on embedded data: CPT then SFT, BF16 vs FP8, report + plot",
    ),
    "train": ("infir2.train.command", "train (CPT or SFT) from a YAML run config"),
    "prepare-cpt": ("infir2.data.command", "tokenize text/JSONL/Parquet into memory-mapped token shards"),
    "eval": ("infir2.eval.command", "evaluate a checkpoint on reasoning benchmarks (JSONL) or held-out loss"),
    "export": ("infir2.export.command", "export a checkpoint as a BF16 or FP8 (128x128 blocks) HF folder"),
    "numerics": (
        "infir2.train.numerics",
        "rank a run's layers by FP8 telemetry (SQNR, underflow); heatmap PNG",
    ),
    "bench": ("infir2.bench.command", "time BF16 vs FP8 linears, quantization kernels and a training step"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infir2",
        description="FP8 training recipe (InfiR2 / DeepSeek-V3 hybrid granularity) for reasoning LMs. "
        "Run `infir2 demo` to see the whole pipeline on a laptop CPU.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and module_name.startswith(e.name):
                continue  # subcommand not built yet
            raise
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    level = logging.DEBUG if args.verbose or os.environ.get("INFIR2_DEBUG") else logging.INFO
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # user errors: one clear line, no traceback
        if args.verbose:
            raise
        print(f"infir2 {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
