"""The engine registry: ``infir2 eval --engine NAME`` and ``rollout.engine: NAME`` both read ``ENGINES``.

An entry (``EngineEntry``) holds everything known of an engine before it is built, declared once: its
factory ``(name, EngineOptions, settings) -> Engine``, the type of its own settings and its traits.
``EngineOptions`` (``base``) is what every engine is built from (the tokenizer, the model, the precision
of ``base.PRECISIONS``); ``settings`` is an instance of the entry's own ``kw_only`` dataclass whose fields
are declared with ``base.knob(default, meaning)`` (``VllmSettings``; None: its defaults). Those fields
are the one declaration of the engine's knobs: RL's ``engine`` section and ``infir2 eval``'s generated
flags (``--tensor-parallel-size`` ...) are read from them. A new engine (an SGLang adapter) is one
module with a class that implements ``base.Engine`` and one ``register_engine(NAME, factory,
settings=ItsSettings, traits=...)``: ``infir2 eval`` then accepts ``--engine NAME`` and its knobs' flags,
and ``infir2 rl`` ``rollout.engine: NAME`` and its ``engine`` section (RL needs ``returns_ids``: token
ids and log-probabilities), with no change to either.

``traits`` (``EngineTraits``) say what the engine is (in this process or not, the precisions it runs,
whether it returns token ids): ``check_engine`` then refuses what it cannot do -- FP8 on a server, RL on
a text-only engine -- in one line naming the flag or key, before any weights are read. ``preflight``
refuses the rest of what needs no weights (vllm: installed, FP8 on this machine, the served dtype) and
says what the engine will report (``base.Preview``). An engine registered without traits is checked
when it is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .base import PRECISIONS, Engine, EngineOptions, Preview
from .builtin import BuiltinEngine, apply_precision, precision_label
from .server import ServerConfig, ServerEngine, check_server
from .vllm_engine import VllmSettings

__all__ = [
    "ENGINES",
    "BuiltinSettings",
    "EngineEntry",
    "EngineFactory",
    "EngineTraits",
    "Preflight",
    "build_engine",
    "check_engine",
    "preflight_engine",
    "register_engine",
]


@dataclass(frozen=True, kw_only=True)
class BuiltinSettings:
    """The built-in engine's own settings: none. What it runs comes from ``EngineOptions`` (the precision,
    RL's copy of the policy, its dtypes, routing replay's records, exact numerics) and ``SamplingConfig`` (its batch size)."""


#: ``factory(name, options, settings)``: ``settings`` an instance of the entry's settings type, or None
EngineFactory = Callable[[str, EngineOptions, Any], Engine]


def _builtin(name: str, o: EngineOptions, settings: BuiltinSettings | None) -> Engine:
    if o.model is None:
        raise ValueError(f"the {name} engine runs a model in this process: give a model")
    model = o.model()
    if o.precision == "recipe":  # fp8 is swapped in by the engine (on its copy in RL)
        apply_precision(model, "recipe", o.recipe)
    return BuiltinEngine(
        model,
        o.tokenizer,
        precision=o.precision,
        scale_encoding=o.scale_encoding,
        model_precision=o.model_precision,
        copy_model=o.copy_model,
        base_dtype=o.base_dtype,
        record_routes=o.record_routes,
        exact=o.exact,
        name=name,
    )


def _builtin_preview(o: EngineOptions, settings: Any, keys: Mapping[str, str]) -> Preview:
    """With --precision recipe every layer it converts runs ``recipe`` (the conversion is checked on the
    meta device by eval)."""
    return Preview(precision_label(o.precision, o.scale_encoding, [o.recipe] if o.recipe else []))


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
        model_precision=o.model_precision,
        name=name,
    )


def _vllm_preflight(o: EngineOptions, settings: Any, keys: Mapping[str, str]) -> Preview:
    from .vllm_engine import preflight  # looked up when called (tests patch the module)

    return preflight(o, settings, keys)


@dataclass(frozen=True)
class EngineTraits:
    """What an engine is, known before it is built (``check_engine``)."""

    in_process: bool  # runs the model in this process (eval: --batch-size, --device ... are its flags)
    precisions: tuple[str, ...]  # the ``EngineOptions.precision`` words it runs; () = what its server loaded
    returns_ids: bool  # token ids and log-probabilities (what RL trains on); False: text only
    records_routes: bool = False  # each sample's MoE experts per token (Sample.routes: RL's routing replay)


#: ``preflight(options, settings, keys)``: refuse, in one line naming ``keys[...]`` (the caller's flag or
#: config key of ``engine``, ``precision``, ``model``, ``device`` and of each setting), what the engine
#: cannot run, before any weights are read; return what it will report
Preflight = Callable[[EngineOptions, Any, Mapping[str, str]], Preview]


@dataclass(frozen=True, kw_only=True)
class EngineEntry:
    """A registered engine: its factory, the type of its own settings (None: it has none), its traits
    (None: checked when built) and its preflight (None: nothing to check before it is built)."""

    factory: EngineFactory
    settings: type | None = None
    traits: EngineTraits | None = None
    preflight: Preflight | None = None


#: engine name -> entry. ``builtin``: KV-cache generation in this process; ``server``: an OpenAI-compatible
#: server; ``vllm``: an in-process ``vllm.LLM`` (``vllm_engine``; vLLM is an optional extra)
ENGINES: dict[str, EngineEntry] = {
    "builtin": EngineEntry(
        factory=_builtin,
        settings=BuiltinSettings,
        traits=EngineTraits(True, tuple(PRECISIONS), True, records_routes=True),
        preflight=_builtin_preview,
    ),
    "server": EngineEntry(factory=_server, settings=ServerConfig, traits=EngineTraits(False, (), False)),
    "vllm": EngineEntry(
        factory=_vllm,
        settings=VllmSettings,
        traits=EngineTraits(True, ("high", "fp8"), True),
        preflight=_vllm_preflight,
    ),
}


_PRECISION_WORDS = {"fp8": "FP8 (the FP8 export's weights)", "recipe": "a training recipe's FP8"}


def register_engine(
    name: str,
    factory: EngineFactory,
    *,
    settings: type | None = None,
    traits: EngineTraits | None = None,
    preflight: Preflight | None = None,
) -> None:
    """Add an engine under ``name`` (or replace one): eval's ``--engine`` and RL's ``rollout.engine`` take it.
    ``settings``: the type of its own settings (a ``kw_only`` dataclass of ``base.knob`` fields: eval's
    flags and RL's ``engine`` section; None: it has none); ``traits``: what it is, so that
    ``check_engine`` refuses what it cannot do before it is built; ``preflight``: its other checks."""
    ENGINES[name] = EngineEntry(factory=factory, settings=settings, traits=traits, preflight=preflight)


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
    traits = ENGINES[name].traits
    if traits is None:
        return None
    if needs_ids and not traits.returns_ids:
        with_ids = [n for n, e in ENGINES.items() if e.traits is not None and e.traits.returns_ids]
        raise ValueError(
            f"{key}: the {name} engine returns text only; RL trains on the engine's token ids and "
            f"log-probabilities (use an in-process engine: {', '.join(with_ids)})"
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


def preflight_engine(
    name: str, options: EngineOptions, settings: Any, keys: Mapping[str, str]
) -> Preview | None:
    """The engine's checks that need no weights (``EngineEntry.preflight``), and what it will report;
    None for an engine that knows its label only when built."""
    entry = ENGINES[name]
    return None if entry.preflight is None else entry.preflight(options, settings, keys)
