"""The engine registry: ``infir2 eval --engine NAME`` and ``rollout.engine: NAME`` both read ``ENGINES``.

An entry is a factory ``(name, EngineOptions) -> Engine``. A new engine (a vLLM or SGLang adapter) is a
module with a class that implements ``base.Engine`` and one ``register_engine(NAME, factory)``;
``infir2 eval`` then accepts ``--engine NAME`` and ``infir2 rl`` ``rollout.engine: NAME`` (RL needs
``returns_ids``: token ids and log-probabilities), with no change to either loop.

``register_engine(NAME, factory, traits)`` may also say what the engine is (``EngineTraits``: in this
process or not, the precisions it runs, whether it returns token ids), known before it is built:
``check_engine`` then refuses what it cannot do -- FP8 serving of a server, RL on a text-only engine --
in one line naming the flag or key, before any weights are read. An engine registered without traits is
checked when it is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .base import Engine
from .builtin import PRECISIONS, BuiltinEngine
from .server import ServerConfig, ServerEngine, check_server

__all__ = [
    "ENGINES",
    "TRAITS",
    "EngineFactory",
    "EngineOptions",
    "EngineTraits",
    "build_engine",
    "check_engine",
    "register_engine",
]


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
    base_dtype: torch.dtype | None = (
        None  # served + copy_model: the other tensors as the FP8 export holds them
    )
    server: ServerConfig | None = None  # a server engine's address and transport settings
    model_dir: str | None = None  # eval: the --model folder, for an engine that reads it itself (vllm)
    settings: Any = (
        None  # an engine's own settings object (vllm: VllmSettings, from its config section / flags)
    )


EngineFactory = Callable[[str, EngineOptions], Engine]


def _builtin(name: str, o: EngineOptions) -> Engine:
    if o.model is None:
        raise ValueError(f"the {name} engine runs a model in this process: give a model")
    return BuiltinEngine(
        o.model(),
        o.tokenizer,
        o.precision,
        o.scale_encoding,
        o.model_precision,
        o.copy_model,
        name,
        o.base_dtype,
    )


def _server(name: str, o: EngineOptions) -> Engine:
    if o.server is None:
        raise ValueError(f"the {name} engine needs a server (--base-url)")
    check_server(o.server)  # reachable, and serving the model asked for
    return ServerEngine(o.server, o.tokenizer, name)


def _vllm(name: str, o: EngineOptions) -> Engine:
    from .vllm_engine import VllmEngine, VllmSettings, require_vllm

    require_vllm()  # one line, before any weights are read
    settings = o.settings if isinstance(o.settings, VllmSettings) else VllmSettings()
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
class EngineTraits:
    """What an engine is, known before it is built (``check_engine``)."""

    in_process: bool  # runs the model in this process (eval: --batch-size, --fp8, --device are its flags)
    precisions: tuple[str, ...]  # the ``EngineOptions.precision`` values it runs; () = what its server loaded
    returns_ids: bool  # token ids and log-probabilities (what RL trains on); False: text only


#: engine name -> factory. ``local`` is eval's name for the built-in engine (`infir2 eval --engine local`);
#: ``vllm`` an in-process ``vllm.LLM`` (``vllm_engine``; vLLM is an optional extra)
ENGINES: dict[str, EngineFactory] = {"builtin": _builtin, "local": _builtin, "server": _server, "vllm": _vllm}
_IN_PROCESS = EngineTraits(True, PRECISIONS, True)
#: engine name -> its traits (an engine registered without them is absent)
TRAITS: dict[str, EngineTraits] = {
    "builtin": _IN_PROCESS,
    "local": _IN_PROCESS,
    "server": EngineTraits(False, (), False),
    "vllm": EngineTraits(True, ("high", "served"), True),  # generation/vllm_engine.py (optional: vLLM)
}


_PRECISION_WORDS = {"fp8": "a training recipe's FP8", "served": "FP8 serving (the FP8 export's weights)"}


def register_engine(name: str, factory: EngineFactory, traits: EngineTraits | None = None) -> None:
    """Add an engine under ``name`` (or replace one): eval's ``--engine`` and RL's ``rollout.engine`` take it.
    ``traits``: what it is, so that ``check_engine`` refuses what it cannot do before it is built."""
    ENGINES[name] = factory
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


def build_engine(name: str, options: EngineOptions) -> Engine:
    check_engine(name, "engine", options.precision)
    return ENGINES[name](name, options)
