"""Generation below ``eval`` and ``rl``: one engine interface, one KV-cache sampler, one FP8 serving linear,
the OpenAI-compatible server client, and the engine registry both ``infir2 eval`` and ``infir2 rl`` read
(``use_exact_numerics``: the switch to ``nn.exact``'s numerics that RL's trainer shares with the engine)."""

from ..nn.exact import use_exact_numerics
from .base import PRECISIONS, Engine, Prompt, Request, RolloutEngine, Sample, SamplingConfig, derive_seeds
from .builtin import BuiltinEngine, check_prompt_fits, precision_label, stops_and_pad
from .fp8_linear import SAME_RECIPE, ServingFp8Linear, serve_fp8
from .registry import (
    ENGINES,
    TRAITS,
    BuiltinSettings,
    EngineEntry,
    EngineOptions,
    EngineTraits,
    build_engine,
    check_engine,
    register_engine,
)
from .sampler import left_pad, sample_batch
from .server import ServerConfig, ServerEngine, ServerError, check_server

__all__ = [
    "ENGINES",
    "PRECISIONS",
    "SAME_RECIPE",
    "TRAITS",
    "BuiltinEngine",
    "BuiltinSettings",
    "Engine",
    "EngineEntry",
    "EngineOptions",
    "EngineTraits",
    "Prompt",
    "Request",
    "RolloutEngine",
    "Sample",
    "SamplingConfig",
    "ServerConfig",
    "ServerEngine",
    "ServerError",
    "ServingFp8Linear",
    "build_engine",
    "check_engine",
    "check_prompt_fits",
    "check_server",
    "derive_seeds",
    "left_pad",
    "precision_label",
    "register_engine",
    "sample_batch",
    "serve_fp8",
    "stops_and_pad",
    "use_exact_numerics",
]
