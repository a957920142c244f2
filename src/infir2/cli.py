"""The ``infir2`` command: the only place that reads argv and the environment.

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and ``run(args)``;
this file only builds the parser, sets up logging, and dispatches. Only the module of the command
being run is imported (``infir2 --help`` and ``infir2 --version`` import no torch), and every
option's default is shown in ``--help`` (``_HelpFormatter``).

torchao is a test oracle, not a runtime dependency; when it is installed (the ``[test]`` extra),
``transformers`` still imports it on every model load, which costs a second and prints warnings
about its optional CUDA extensions. ``main`` hides it from ``transformers`` for the command's
duration (``_without_torchao``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata

from ._logging import setup_logging

__all__ = ["COMMANDS", "build_parser", "main"]

#: subcommand -> (module, one-line help). Modules are imported lazily: `infir2 --help` stays fast.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "infir2.tools.demo.command",
        "the whole recipe on embedded data: CPT then SFT, BF16 vs FP8, report + plot",
    ),
    "train": ("infir2.train.command", "train (CPT or SFT) from a YAML run config or a shipped config's name"),
    "config": (
        "infir2.tools.config",
        "every run-config key of every stage: default and meaning; check a config",
    ),
    "rl": ("infir2.rl.command", "reinforcement learning (GRPO / DAPO) on verifiable math with FP8 rollouts"),
    "prepare-cpt": ("infir2.data.command", "tokenize text/JSONL/Parquet into memory-mapped token shards"),
    "eval": ("infir2.eval.command", "evaluate a checkpoint on reasoning benchmarks (JSONL) or held-out loss"),
    "export": ("infir2.export.command", "export a checkpoint as a BF16 or FP8 (128x128 blocks) HF folder"),
    "numerics": (
        "infir2.tools.numerics",
        "rank a run's layers by FP8 telemetry (SQNR, underflow); heatmap PNG",
    ),
    "bench": (
        "infir2.tools.bench.command",
        "time BF16 vs FP8 linears, quantization kernels and a training step",
    ),
    "fidelity": (
        "infir2.tools.bench.fidelity",
        "held-out loss of every FP8 recipe vs the baseline on real text, by width",
    ),
    "memory": (
        "infir2.tools.memory",
        "bytes one decoder layer keeps for backward, tensor by tensor, BF16 vs FP8",
    ),
    "plan": (
        "infir2.tools.plan",
        "per-GPU memory and all-gather bytes of a run, BF16 vs FP8, before you launch it",
    ),
}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the module docstrings' layout and appends ``(default: X)`` to options that have one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        default = action.default
        if (
            "%(default)" in help_text
            or "default" in help_text.lower()
            or default is argparse.SUPPRESS
            or default in (None, False, [])
            or isinstance(action, argparse._VersionAction)
        ):
            return action.help
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            help_text += " (default: %(default)s)"
        return help_text


def _version() -> str:
    version = importlib.import_module("infir2").__version__  # the package itself: light (lazy __init__)
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"infir2 {version} (torch {torch_version}, Python {sys.version.split()[0]})"


def _requested_command(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not an option), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(argv: list[str] | None = None, full: bool = False) -> argparse.ArgumentParser:
    """The ``infir2`` parser. Imports the module of the command named in ``argv`` (all with ``full``)."""
    wanted = _requested_command(argv or [])
    parser = argparse.ArgumentParser(
        prog="infir2",
        description="FP8 training recipe (InfiR2 / DeepSeek-V3 hybrid granularity) for reasoning LMs.\n"
        "Run `infir2 demo` to see the whole pipeline on a laptop CPU; `infir2 COMMAND --help` for a command.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if not full and name != wanted:  # listed in `infir2 --help`; its module is not imported
            sub.add_parser(name, help=help_text, description=help_text, add_help=False)
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).strip(),
            formatter_class=_HelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


@contextmanager
def _without_torchao() -> Iterator[None]:
    """Make ``import torchao`` fail (and ``transformers`` see no torchao) inside the block.

    ``sys.modules[name] = None`` is Python's documented way to block an import; it is undone on exit
    so that a caller in the same process (the test suite, which uses torchao as an oracle) keeps it.
    Does nothing if torchao is already imported.
    """
    if "torchao" in sys.modules or os.environ.get("INFIR2_ALLOW_TORCHAO"):
        yield
        return
    sys.modules["torchao"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if "torchao" in sys.modules and sys.modules["torchao"] is None:
            del sys.modules["torchao"]


#: flags a release had and this one has not (command -> flag -> what to give instead): argparse's
#: "unrecognized arguments" says what is wrong, this says what to do
REMOVED_FLAGS: dict[str, dict[str, str]] = {
    "eval": {
        "--fp8": "--fp8 was replaced by --precision: --precision fp8 for the FP8 export's weights as "
        "deployed, --precision recipe --recipe NAME for a training recipe's FP8 forward",
    },
    "train": {
        "--fp8": "--fp8 is not a flag of infir2 train: the training recipe is the config's fp8.recipe "
        "(e.g. --set fp8.recipe=blockwise)",
    },
    "rl": {
        "--fp8": "--fp8 is not a flag of infir2 rl: the training recipe is the config's fp8.recipe and the "
        "rollouts' precision rollout.precision (e.g. --set fp8.recipe=blockwise --set rollout.precision=fp8)",
    },
}


def _removed_flag(argv: list[str]) -> str | None:
    """The migration line of a removed flag in ``argv`` (``--fp8`` or ``--fp8=X``), if any."""
    removed = REMOVED_FLAGS.get(_requested_command(argv) or "", {})
    for word in argv:
        if (flag := word.split("=", 1)[0]) in removed:
            return removed[flag]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if line := _removed_flag(argv):
        print(f"infir2 {_requested_command(argv)}: error: {line}", file=sys.stderr, flush=True)
        return 2
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose or os.environ.get("INFIR2_DEBUG") else logging.INFO
    # under torchrun: INFO from rank 0 only, warnings and errors from every rank with its number
    setup_logging(level, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        with _without_torchao():
            return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # user errors: one clear line, no traceback
        if args.verbose:
            raise
        _report(f"infir2 {args.command}: error: {e}")
        return 2


def _report(line: str) -> None:
    """The error line on stderr; under torchrun once for the job (rank 0's; another rank's only when
    its cause differs: ``_dist.report_once`` over the launcher's store), not once per rank."""

    def write(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        write(line)
        return
    from ._dist import LaunchStore, report_once

    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" and "MASTER_PORT" in os.environ:
        attempt = (
            f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        )
        store = LaunchStore(
            os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), attempt
        )
    report_once(line, int(os.environ.get("RANK", "0")), store, write)


if __name__ == "__main__":
    sys.exit(main())
