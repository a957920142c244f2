"""The engine registry: ``infir2 eval --engine NAME`` and ``rollout.engine: NAME`` both read ``ENGINES``.

An entry is a factory ``(name, EngineOptions) -> Engine``. A new engine (a vLLM or SGLang adapter) is a
module with a class that implements ``base.Engine`` and one ``register_engine(NAME, factory)``;
``infir2 eval`` then accepts ``--engine NAME`` and ``infir2 rl`` ``rollout.engine: NAME`` (RL needs
``returns_ids``: token ids and log-probabilities), with no change to either loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from .base import Engine
from .builtin import BuiltinEngine
from .server import ServerConfig, ServerEngine, check_server

__all__ = ["ENGINES", "EngineFactory", "EngineOptions", "build_engine", "register_engine"]


@dataclass
class EngineOptions:
    """What an engine may be built from: ``infir2 eval``'s flags, or the RL config and its policy."""

    tokenizer: Any
    model: Callable[[], nn.Module] | None = (
        None  # in-process engines call it (eval loads, RL hands the policy)
    )
    precision: str = "high"  # high | fp8 (the model's Fp8Linear layers) | served (the FP8 export's linear)
    scale_encoding: str = "pow2"  # served: the export's block scales (pow2 | fp32)
    model_precision: str | None = None  # autocast of the high-precision parts (RL: model.precision)
    copy_model: bool = False  # RL: generate from a copy that load_weights refreshes
    server: ServerConfig | None = None  # a server engine's address and transport settings


EngineFactory = Callable[[str, EngineOptions], Engine]


def _builtin(name: str, o: EngineOptions) -> Engine:
    if o.model is None:
        raise ValueError(f"the {name} engine runs a model in this process: give a model")
    return BuiltinEngine(
        o.model(), o.tokenizer, o.precision, o.scale_encoding, o.model_precision, o.copy_model, name
    )


def _server(name: str, o: EngineOptions) -> Engine:
    if o.server is None:
        raise ValueError(f"the {name} engine needs a server (--base-url)")
    check_server(o.server)  # reachable, and serving the model asked for
    return ServerEngine(o.server, o.tokenizer, name)


#: engine name -> factory. ``local`` is eval's name for the built-in engine (`infir2 eval --engine local`).
ENGINES: dict[str, EngineFactory] = {"builtin": _builtin, "local": _builtin, "server": _server}


def register_engine(name: str, factory: EngineFactory) -> None:
    """Add an engine under ``name`` (or replace one): eval's ``--engine`` and RL's ``rollout.engine`` take it."""
    ENGINES[name] = factory


def build_engine(name: str, options: EngineOptions) -> Engine:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}: expected one of {', '.join(ENGINES)}")
    return ENGINES[name](name, options)
