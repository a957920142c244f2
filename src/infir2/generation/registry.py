"""The engine registry: ``infir2 eval --engine NAME`` and ``rollout.engine: NAME`` both read ``ENGINES``.

An entry (``EngineEntry``) is a factory ``(name, EngineOptions, settings) -> Engine`` and the type of the
engine's own settings: ``EngineOptions`` is what every engine is built from (the tokenizer, the model,
the precision of ``base.PRECISIONS``); ``settings`` is an instance of the entry's own dataclass
(``BuiltinSettings``, ``ServerConfig``, ``VllmSettings``; None: its defaults), so a new engine adds its
settings without touching another engine's. A new engine (an SGLang adapter) is a module with a class
that implements ``base.Engine`` and one ``register_engine(NAME, factory, settings=ItsSettings)``;
``infir2 eval`` then accepts ``--engine NAME`` and ``infir2 rl`` ``rollout.engine: NAME`` (RL needs
``returns_ids``: token ids and log-probabilities), with no change to either loop.

``register_engine(..., traits=EngineTraits(...))`` may also say what the engine is (in this process or
not, the precisions it runs, whether it returns token ids), known before it is built: ``check_engine``
then refuses what it cannot do -- FP8 on a server, RL on a text-only engine -- in one line naming the
flag or key, before any weights are read. An engine registered without traits is checked when it is
built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .base import PRECISIONS, Engine
from .builtin import BuiltinEngine
from .server import ServerConfig, ServerEngine, check_server
from .vllm_engine import VllmSettings

__all__ = [
    "ENGINES",
    "TRAITS",
    "BuiltinSettings",
    "EngineEntry",
    "EngineFactory",
    "EngineOptions",
    "EngineTraits",
    "build_engine",
    "check_engine",
    "register_engine",
]


@dataclass(frozen=True)
class EngineOptions:
    """What every engine is built from: ``infir2 eval``'s flags, or the RL config and its policy."""

    tokenizer: Any
    model: Callable[[], nn.Module] | None = (
        None  # in-process engines call it (eval loads, RL hands the policy)
    )
    precision: str = "high"  # a word of base.PRECISIONS: high | fp8 (the FP8 export's weights) | recipe
    scale_encoding: str = "pow2"  # fp8: the export's block scales (pow2 | fp32)
    model_dir: str | None = None  # eval: the --model folder, for an engine that reads it itself (vllm)


@dataclass(frozen=True)
class BuiltinSettings:
    """The built-in engine's own settings (``BuiltinEngine``)."""

    model_precision: str | None = None  # autocast of the high-precision parts (RL: model.precision)
    copy_model: bool = False  # RL: generate from a copy that load_weights refreshes
    base_dtype: torch.dtype | None = None  # fp8 + copy_model: the other tensors as the FP8 export holds them
    exact: bool = False  # decode with exact numerics (nn.exact; RL: rollout.exact)


#: ``factory(name, options, settings)``: ``settings`` an instance of the entry's settings type, or None
EngineFactory = Callable[[str, EngineOptions, Any], Engine]


def _builtin(name: str, o: EngineOptions, settings: BuiltinSettings | None) -> Engine:
    if o.model is None:
        raise ValueError(f"the {name} engine runs a model in this process: give a model")
    s = settings or BuiltinSettings()
    return BuiltinEngine(
        o.model(),
        o.tokenizer,
        o.precision,
        o.scale_encoding,
        s.model_precision,
        s.copy_model,
        name,
        s.base_dtype,
        s.exact,
    )


def _server(name: str, o: EngineOptions, settings: ServerConfig | None) -> Engine:
    if settings is None:
        raise ValueError(f"the {name} engine needs a server (--base-url)")
    check_server(settings)  # reachable, and serving the model asked for
    return ServerEngine(settings, o.tokenizer, name)


def _vllm(name: str, o: EngineOptions, settings: VllmSettings | None) -> Engine:
    from .vllm_engine import VllmEngine, require_vllm  # looked up when built (tests patch it)

    require_vllm()  # one line, before any weights are read
    settings = settings or VllmSettings()
    if o.model_dir is not None and o.precision == "high":  # vLLM reads the folder itself
        return VllmEngine(o.tokenizer, settings, folder=o.model_dir, name=name)
    if o.model is None:
        raise ValueError(f"the {name} engine needs a model folder or a model")
    policy = o.model()
    return VllmEngine(
        o.tokenizer,
        settings,
        policy=policy,
        precision=o.precision,
        scale_encoding=o.scale_encoding,
        name=name,
    )


@dataclass(frozen=True)
class EngineEntry:
    """A registered engine: its factory and the type of its own settings (None: it has none)."""

    factory: EngineFactory
    settings: type | None = None


@dataclass(frozen=True)
class EngineTraits:
    """What an engine is, known before it is built (``check_engine``)."""

    in_process: bool  # runs the model in this process (eval: --batch-size, --device ... are its flags)
    precisions: tuple[str, ...]  # the ``EngineOptions.precision`` words it runs; () = what its server loaded
    returns_ids: bool  # token ids and log-probabilities (what RL trains on); False: text only


#: engine name -> entry. ``builtin``: KV-cache generation in this process; ``server``: an OpenAI-compatible
#: server; ``vllm``: an in-process ``vllm.LLM`` (``vllm_engine``; vLLM is an optional extra)
ENGINES: dict[str, EngineEntry] = {
    "builtin": EngineEntry(_builtin, BuiltinSettings),
    "server": EngineEntry(_server, ServerConfig),
    "vllm": EngineEntry(_vllm, VllmSettings),
}
#: engine name -> its traits (an engine registered without them is absent)
TRAITS: dict[str, EngineTraits] = {
    "builtin": EngineTraits(True, tuple(PRECISIONS), True),
    "server": EngineTraits(False, (), False),
    "vllm": EngineTraits(True, ("high", "fp8"), True),  # generation/vllm_engine.py (optional: vLLM)
}


_PRECISION_WORDS = {"fp8": "FP8 (the FP8 export's weights)", "recipe": "a training recipe's FP8"}


def register_engine(
    name: str, factory: EngineFactory, settings: type | None = None, traits: EngineTraits | None = None
) -> None:
    """Add an engine under ``name`` (or replace one): eval's ``--engine`` and RL's ``rollout.engine`` take it.
    ``settings``: the type of its own settings (a dataclass; None: it has none); ``traits``: what it is,
    so that ``check_engine`` refuses what it cannot do before it is built."""
    ENGINES[name] = EngineEntry(factory, settings)
    if traits is None:
        TRAITS.pop(name, None)
    else:
        TRAITS[name] = traits


def check_engine(
    name: str,
    key: str,
    precision: str = "high",
    precision_key: str = "",
    needs_ids: bool = False,
) -> EngineTraits | None:
    """Refuse, in one line naming ``key`` (the engine's flag or config key) or ``precision_key``, an engine
    that is not registered, or one whose traits say it cannot run ``precision`` or return token ids
    (``needs_ids``). Returns its traits (None: registered without them, checked when built)."""
    if name not in ENGINES:
        raise ValueError(
            f"{key}: got {name!r}, expected one of {', '.join(ENGINES)} (the registered engines)"
        )
    traits = TRAITS.get(name)
    if traits is None:
        return None
    if needs_ids and not traits.returns_ids:
        raise ValueError(
            f"{key}: the {name} engine returns text only; RL trains on the engine's token ids and "
            f"log-probabilities (use an in-process engine: {', '.join(n for n, t in TRAITS.items() if t.returns_ids)})"
        )
    if precision != "high" and precision not in traits.precisions:
        runs = (
            f"runs only {', '.join(traits.precisions)}"
            if traits.precisions
            else "runs the precision its server loaded (serve the FP8 export of `infir2 export --format fp8` for FP8)"
        )
        raise ValueError(
            f"{precision_key or key}: the {name} engine cannot run "
            f"{_PRECISION_WORDS.get(precision, repr(precision))}: it {runs}"
        )
    return traits


def build_engine(name: str, options: EngineOptions, settings: Any = None) -> Engine:
    """The engine ``name`` built from ``options`` and ``settings`` (an instance of its entry's settings
    type, or None for its defaults)."""
    check_engine(name, "engine", options.precision)
    entry = ENGINES[name]
    if settings is not None and (entry.settings is None or not isinstance(settings, entry.settings)):
        want = "none" if entry.settings is None else entry.settings.__name__
        raise TypeError(f"the {name} engine's settings are {want}, got a {type(settings).__name__}")
    return entry.factory(name, options, settings)
