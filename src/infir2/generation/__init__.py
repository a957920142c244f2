"""Generation below ``eval`` and ``rl``: one engine interface, one KV-cache sampler, one FP8 serving linear,
the OpenAI-compatible server client, and the engine registry both ``infir2 eval`` and ``infir2 rl`` read
(``use_exact_numerics``: the switch to ``nn.exact``'s numerics that RL's trainer shares with the engine)."""

from ..nn.exact import use_exact_numerics
from .base import (
    PRECISIONS,
    Engine,
    EngineOptions,
    Preview,
    Prompt,
    Request,
    RolloutEngine,
    Sample,
    SamplingConfig,
    check_prompt_fits,
    derive_seeds,
    knob,
    knobs,
    stops_and_pad,
)
from .builtin import BuiltinEngine, apply_precision, precision_label
from .fp8_linear import SAME_RECIPE, ServingFp8Linear, serve_fp8
from .registry import (
    ENGINES,
    BuiltinSettings,
    EngineEntry,
    EngineTraits,
    build_engine,
    check_engine,
    preflight_engine,
    register_engine,
)
from .sampler import left_pad, sample_batch
from .server import ServerConfig, ServerEngine, ServerError, check_server

__all__ = [
    "ENGINES",
    "PRECISIONS",
    "SAME_RECIPE",
    "BuiltinEngine",
    "BuiltinSettings",
    "Engine",
    "EngineEntry",
    "EngineOptions",
    "EngineTraits",
    "Preview",
    "Prompt",
    "Request",
    "RolloutEngine",
    "Sample",
    "SamplingConfig",
    "ServerConfig",
    "ServerEngine",
    "ServerError",
    "ServingFp8Linear",
    "apply_precision",
    "build_engine",
    "check_engine",
    "check_prompt_fits",
    "check_server",
    "derive_seeds",
    "knob",
    "knobs",
    "left_pad",
    "precision_label",
    "preflight_engine",
    "register_engine",
    "sample_batch",
    "serve_fp8",
    "stops_and_pad",
    "use_exact_numerics",
]
