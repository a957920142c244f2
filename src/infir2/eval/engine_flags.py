"""`infir2 eval`'s engine flags: the precision (``--precision``, the words of ``generation.PRECISIONS``)
and each engine's own -- the built-in engine's and a server's written here, every other engine's
generated from its settings' fields (``generation.knob``: vllm's ``--tensor-parallel-size`` ...,
or those of an engine registered by name) -- refused when given to another engine, checked before
anything is read, and turned into the engine they build (``EngineOptions`` and the engine's own
settings)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

from ..generation import ENGINES, PRECISIONS, check_engine, knobs, preflight_engine
from ..model import resolve_device
from .config import EvalConfig, EvalGeneration, EvalSampling, EvalServer, defaults

__all__ = [
    "IN_PROCESS_FLAGS",
    "SERVER_FLAGS",
    "add_engine_arguments",
    "build_eval_engine",
    "check_engine_flags",
    "check_server_flags",
    "engine_knob_flags",
    "engine_preview",
    "load_model",
    "parse_extra_body",
]


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The precision flags and the flags of the built-in, server and vllm engines."""
    c = p.add_argument_group("precision (what the engine computes with)")
    c.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default="high",
        help="high (default): no FP8, the model's own dtype; fp8: the FP8 export's weights as deployed "
        "(128x128 weight blocks made by the export's quantizer, 1x128 activations); recipe: a training "
        "recipe's FP8 forward through Fp8Linear layers (--recipe NAME)",
    )
    c.add_argument(
        "--recipe",
        help="--precision recipe: the training recipe (e.g. blockwise; `infir2 config --keys` lists "
        "fp8.recipe's names)",
    )
    c.add_argument(
        "--scale-encoding",
        choices=["pow2", "fp32"],
        help="--precision fp8: the export's block scales (as `infir2 export --scale-encoding`; default pow2)",
    )
    g = p.add_argument_group("builtin engine")
    g.add_argument("--batch-size", type=int, help="sequences generated together (default: 8)")
    g.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    s = p.add_argument_group("server engine")
    s.add_argument("--base-url", help="the server, e.g. http://127.0.0.1:8000 (the /v1 is added)")
    s.add_argument("--concurrency", type=int, help="requests in flight (the server batches them; default: 8)")
    s.add_argument("--request-timeout", type=float, help="seconds one request may take (default: 3600)")
    s.add_argument(
        "--retries",
        type=int,
        help="retries of a request after a connection error, timeout, 429 or 5xx (backoff 1, 2, 4 "
        "... s, at most 60; default: 8)",
    )
    s.add_argument(
        "--samples-per-request",
        type=int,
        help="samples asked for in one request (the API's n; default: all of a problem's)",
    )
    s.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    s.add_argument(
        "--extra-body",
        help="JSON merged into every request, for engine extensions, e.g. '{\"top_k\": -1}' (default: {})",
    )
    _add_knob_flags(p)


#: flags of before the engines declared their settings, and what each is now
_MOVED_FLAGS = {"cuda_graphs": "--cuda-graphs is now --no-enforce-eager (the vllm engine's enforce_eager)"}


def engine_knob_flags() -> dict[str, list[tuple[str, Any]]]:
    """Each registered engine's generated flags: flag -> the settings field it sets (``generation.knobs``)."""
    return {name: [(_flag(f.name), f) for f in knobs(entry.settings)] for name, entry in ENGINES.items()}


def _add_knob_flags(p: argparse.ArgumentParser) -> None:
    """One flag per knob of every registered engine (``--NAME-WITH-DASHES``), typed by its annotation;
    a knob two engines share is one flag."""
    added: set[str] = set()
    for name, flags in engine_knob_flags().items():
        group = p.add_argument_group(f"{name} engine (its settings' fields)") if flags else None
        hints = typing.get_type_hints(ENGINES[name].settings) if flags else {}
        for flag, f in flags:
            if flag in added:
                continue
            if flag in p._option_string_actions:
                raise ValueError(
                    f"engine {name}: its setting {f.name} would be {flag}, a flag of infir2 eval"
                )
            assert group is not None
            group.add_argument(flag, dest=_knob_dest(f.name), **_knob_kwargs(hints[f.name], f))
            added.add(flag)
    p.add_argument("--cuda-graphs", action="store_true", help=argparse.SUPPRESS)  # refused: _MOVED_FLAGS


def _knob_dest(name: str) -> str:
    return f"knob_{name}"


def _knob_kwargs(tp: Any, f: Any) -> dict[str, Any]:
    """argparse's type, choices or action for a knob of annotation ``tp`` (``X | None`` as ``X``)."""
    meaning = f"{f.metadata['help']} (default: {f.default})"
    options = (
        [t for t in typing.get_args(tp) if t is not type(None)] if type(None) in typing.get_args(tp) else [tp]
    )
    tp = options[0]
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction, "default": None, "help": meaning}
    if typing.get_origin(tp) is typing.Literal:
        return {"choices": list(typing.get_args(tp)), "help": meaning}
    return {"type": tp, "metavar": f.name.upper(), "help": meaning}


#: each engine's own flags (dest -> default): given to an engine of the other kind, they are refused
IN_PROCESS_FLAGS: dict[str, Any] = {
    **defaults(EvalGeneration, ("batch_size", "recipe", "scale_encoding", "device")),
    **defaults(EvalSampling, ("beyond_context",)),
}


SERVER_FLAGS: dict[str, Any] = {**defaults(EvalServer), "extra_body": "{}"}  # --extra-body: JSON text


def _engine_settings(args: argparse.Namespace) -> Any:
    """The generated flags of ``--engine``'s settings as its settings (a flag of another engine is
    refused, a value out of range too)."""
    for dest, line in _MOVED_FLAGS.items():
        if getattr(args, dest, False):
            raise ValueError(line)
    own = {flag for flag, _ in engine_knob_flags()[args.engine]}
    for name, flags in engine_knob_flags().items():
        for flag, f in flags:
            if flag not in own and _given(getattr(args, _knob_dest(f.name), None)):
                raise ValueError(f"{flag} is a flag of --engine {name}, not of --engine {args.engine}")
    kind = ENGINES[args.engine].settings
    settings = kind() if kind is not None and not dataclasses.fields(kind) else None  # none of its own
    if knobs(kind):
        given = {f.name: getattr(args, _knob_dest(f.name)) for _, f in engine_knob_flags()[args.engine]}
        try:
            settings = kind(**{k: v for k, v in given.items() if v is not None})  # type: ignore[misc]
        except ValueError as e:
            raise ValueError(f"--engine {args.engine}: {e}") from None
    return settings


def _given(value: Any) -> bool:
    """A flag was given: not its unset ``None`` nor a switch left off. A value of 0 is a value given
    (``0 in (None, False)`` is true in Python: ``--tensor-parallel-size 0`` passed for not given)."""
    return value is not None and value is not False


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_engine_flags(args: argparse.Namespace) -> None:
    """Refuse a flag of another kind of engine (its ``EngineTraits``: an in-process engine's --batch-size, --recipe,
    --scale-encoding, --device, --beyond-context; a server's --base-url, --concurrency ...), what the
    engine cannot run (``check_engine``: --precision fp8 on a server) and a --recipe or --scale-encoding
    without its precision, in one line naming the flag, before anything is read; then fill the defaults
    of the flags not given."""
    traits = check_engine(args.engine, "--engine", args.precision, "--precision")
    args.engine_settings = _engine_settings(args)
    given = [d for d in (*IN_PROCESS_FLAGS, *SERVER_FLAGS) if _given(getattr(args, d))]
    for dest in given:
        server_flag = dest in SERVER_FLAGS
        if traits is not None and server_flag == traits.in_process:
            kind = "--engine server" if server_flag else "an in-process engine (--engine builtin)"
            raise ValueError(f"{_flag(dest)} is a flag of {kind}, not of --engine {args.engine}")
    if args.precision == "recipe" and args.recipe is None:
        raise ValueError(
            "--precision recipe needs --recipe NAME (`infir2 config --keys` lists fp8.recipe's names)"
        )
    if args.recipe is not None and args.precision != "recipe":
        raise ValueError(
            f"--recipe names the training recipe of --precision recipe, not of --precision {args.precision}"
        )
    if args.scale_encoding is not None and args.precision != "fp8":
        raise ValueError(
            "--scale-encoding sets the block scales of --precision fp8: give it with --precision fp8"
        )
    for dest, default in (*IN_PROCESS_FLAGS.items(), *SERVER_FLAGS.items()):
        if getattr(args, dest) is None:
            setattr(args, dest, default)


def load_model(cfg: EvalConfig):
    """The model of --model on --device, as stored (the engine applies --precision)."""
    from ..export import load_checkpoint

    return load_checkpoint(cfg.model.path, device=str(resolve_device(cfg.generation.device)))


def _options(cfg: EvalConfig, tokenizer: Any) -> Any:
    """What every engine is built from: the precision and recipe (both applied by the engine), the model
    folder and its loader (``load_model``)."""
    from ..generation import EngineOptions

    g = cfg.generation
    return EngineOptions(
        tokenizer=tokenizer,
        model=lambda: load_model(cfg),
        precision=g.precision,
        recipe=g.recipe,
        scale_encoding=g.scale_encoding,
        model_dir=cfg.model.path,
        device=g.device,
    )


def engine_preview(cfg: EvalConfig) -> Any:
    """The engine's checks that need no weights (``generation.preflight_engine``: vllm installed, FP8 on
    this machine, its served dtype), each refusal one line naming the flag; what the engine will report
    (``generation.Preview``; None where only the built engine knows)."""
    name = cfg.generation.engine
    keys = {
        "engine": f"--engine {name}",
        "precision": "--precision",
        "model": "--model",
        "device": "--device",
    }
    keys |= {f.name: flag for flag, f in engine_knob_flags()[name]}
    return preflight_engine(name, _options(cfg, tokenizer=None), cfg.engine, keys)


def build_eval_engine(cfg: EvalConfig, tokenizer):
    """The engine of ``generation.engine``: the options every engine takes, and the engine's own settings
    (a server's from the server section; the others' the config's ``engine``)."""
    from ..generation import build_engine

    name = cfg.generation.engine
    own = _server_config(cfg) if name == "server" and cfg.server.base_url else cfg.engine
    return build_engine(name, _options(cfg, tokenizer), own)


def check_server_flags(args: argparse.Namespace) -> None:
    """The server engine's flags, before anything is loaded."""
    if args.engine != "server":
        return
    if not args.base_url:
        raise ValueError("--engine server needs --base-url (e.g. http://127.0.0.1:8000)")
    parse_extra_body(args.extra_body)
    if args.tokenizer is None and not Path(args.model).is_dir():
        raise ValueError(
            f"--engine server needs --tokenizer FOLDER to render the prompts (--model {args.model!r} "
            f"is the served name, not a folder)"
        )


def parse_extra_body(text: str) -> dict[str, Any]:
    """--extra-body's JSON object."""
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body is not JSON ({e.msg}): {text!r}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {text!r}")
    return extra


#: the server engine's flags -> the fields of its settings (``ServerConfig``)
_SERVER_FIELDS = {
    "concurrency": "concurrency",
    "request_timeout": "timeout_s",
    "retries": "retries",
    "samples_per_request": "samples_per_request",
    "api_key": "api_key",
}


def _server_config(cfg: EvalConfig):
    from ..generation import ServerConfig

    own = {field: getattr(cfg.server, key) for key, field in _SERVER_FIELDS.items()}
    return ServerConfig(
        base_url=cfg.server.base_url or "",
        model=cfg.model.path,
        extra_body=cfg.server.extra_body or {},
        **own,
    )
