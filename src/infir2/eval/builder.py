"""The one builder of `infir2 eval`'s typed config: ``eval_config`` turns the command line into a frozen
``config.EvalConfig`` -- every flag checked (``mode_flags``, ``engine_flags``, ``flags``), a preset's and
the protocol's defaults filled, the engine's own refusals made (``engine_flags.engine_preview``) -- and
the rest of ``eval/`` reads that, never the argparse namespace.

A YAML eval config (``infir2 config FILE``) is read by ``parse_eval_config``: keys and types checked by
``harness.typed_yaml``, then rendered as eval's command line (``eval_argv``) and built by the same
builder, so a YAML config is checked by exactly the rules of the flags (each refusal names the file and
the flag); what ``infir2 config`` prints reads back to the same config.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ..data.chat import SYSTEM_PROMPT, THINK_PREFIX
from ..generation import ENGINES
from ..harness.config import load_stage_config, settings_section
from ..harness.typed_yaml import build
from .config import SECTION_TYPES, EvalConfig
from .engine_flags import (
    IN_PROCESS_FLAGS,
    check_engine_flags,
    engine_knob_flags,
    engine_preview,
    parse_extra_body,
)
from .flags import add_arguments, resolve_protocol
from .mode_flags import check_mode_flags, check_recipe

__all__ = ["eval_argv", "eval_config", "load_eval_config", "parse_eval_config"]


def eval_config(args: argparse.Namespace) -> EvalConfig:
    """The one builder: every flag of ``args`` checked (each refusal one line naming the flag, before
    anything is read), the defaults filled (explicit flag > preset > default), as a frozen config."""
    if args.perplexity and args.engine != "builtin":
        raise ValueError("--perplexity runs the model in this process: use --engine builtin")
    check_mode_flags(args)
    check_engine_flags(args)
    check_recipe(args)
    resolve_protocol(args, checked=not args.perplexity)
    cfg = _from_args(args)
    engine_preview(cfg)  # the engine's own refusals (vllm: installed, FP8 here, its dtype), before any read
    return cfg


def _from_args(args: argparse.Namespace) -> EvalConfig:
    sections: dict[str, Any] = {}
    for section in fields(EvalConfig):
        if section.name == "engine":
            continue
        sections[section.name] = {
            f.name: getattr(args, _dest(f), None) for f in fields(SECTION_TYPES[section.name])
        }
    sections["server"]["extra_body"] = parse_extra_body(args.extra_body)
    sections["sampling"]["max_new_tokens_from"] = args.budget_from
    built = {name: SECTION_TYPES[name](**values) for name, values in sections.items()}
    return EvalConfig(**built, engine=args.engine_settings)


def _dest(f: Any) -> str:
    """The argparse dest of a field: its flag's name, else its own."""
    flag = f.metadata.get("flag")
    return flag.removeprefix("--").replace("-", "_") if flag else f.name


#: the fields of each kind of run: eval_argv gives a flag only where eval takes it
_BENCHMARK_ONLY = ("benchmark", "sampling")
_SERVER_ONLY = ("server",)


def eval_argv(cfg: EvalConfig) -> list[str]:
    """``cfg`` as eval's command line (``infir2 eval`` + these): the flags its mode and engine take, each
    with its value (none for a value the builder fills again: a preset's budget, the protocol's prompt,
    an unset null, a switch left off)."""
    traits = ENGINES[cfg.generation.engine].traits if cfg.generation.engine in ENGINES else None
    in_process = traits is None or traits.in_process
    argv: list[str] = []
    for section in fields(EvalConfig):
        name = section.name
        if name == "engine" or (name in _BENCHMARK_ONLY and cfg.loss.tokens_dir):
            continue
        if (name == "loss" and not cfg.loss.tokens_dir) or (name in _SERVER_ONLY and in_process):
            continue
        for f in fields(SECTION_TYPES[name]):
            if not in_process and f.name in IN_PROCESS_FLAGS:  # their names are the fields'
                continue
            argv += _flag_of(cfg, name, f)
    for flag, f in engine_knob_flags().get(cfg.generation.engine, []):
        value = getattr(cfg.engine, f.name)
        if value != f.default:
            argv += (
                [("--" if value else "--no-") + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
            )
    return argv


def _flag_of(cfg: EvalConfig, section: str, f: Any) -> list[str]:
    """The flag of one field (none for a value the flag leaves as it is)."""
    value = getattr(getattr(cfg, section), f.name)
    flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
    if f.name == "max_new_tokens" and cfg.sampling.max_new_tokens_from != "--max-new-tokens":
        return []  # a preset's or the default: filled again by the builder
    if f.name == "system_prompt":
        return ["--no-system-prompt"] if value is None else [] if value == SYSTEM_PROMPT else [flag, value]
    if f.name == "think_prefix":
        return ["--no-think-prefix"] if value == "" else [] if value == THINK_PREFIX else [flag, value]
    if f.name == "scale_encoding" and cfg.generation.precision != "fp8":
        return []  # a flag of --precision fp8 only
    if f.name == "max_new_tokens_from" or value is None or value is False:
        return []
    if value is True:
        return [flag]
    if f.name == "extra_body":
        return [flag, json.dumps(value)] if value else []
    return [flag, str(value)]


def parse_eval_config(data: dict[str, Any], source: str = "<dict>") -> EvalConfig:
    """A YAML eval config (parsed) checked as `infir2 eval` checks its flags: keys and types here, then
    its command line (``eval_argv``) through the one builder; errors name ``source``."""
    data = dict(data)
    generation = data.get("generation")
    engine = generation.get("engine", "builtin") if isinstance(generation, dict) else "builtin"
    section = data.pop("engine", None)
    typed = build(EvalConfig, data, "", source)
    if engine in ENGINES:
        typed = _with_engine(typed, settings_section(ENGINES[engine].settings, engine, section, source))
    parser = argparse.ArgumentParser(prog="infir2 eval", exit_on_error=False)
    add_arguments(parser)
    try:
        return eval_config(parser.parse_args(eval_argv(typed)))
    except (ValueError, argparse.ArgumentError) as e:
        raise ValueError(f"{source}: {e}") from None


def _with_engine(cfg: EvalConfig, settings: Any) -> EvalConfig:
    return replace(cfg, engine=settings)


def load_eval_config(path: str | Path, overrides: list[str] | None = None) -> EvalConfig:
    """Read a YAML eval config, apply ``--set`` overrides, check it. Errors name the key and the file."""
    return load_stage_config(Path(path), parse_eval_config, overrides)
