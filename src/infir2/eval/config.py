"""`infir2 eval`'s typed config (``EvalConfig``): frozen sections, as `infir2 train` and `infir2 rl` have
(``infir2 config --keys --stage eval`` lists every key with its default and meaning; each key is a flag
of `infir2 eval`). ``builder.eval_config`` makes one from the command line, ``builder.parse_eval_config``
from YAML; the rest of ``eval/`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from ..data.chat import SYSTEM_PROMPT, THINK_PREFIX
from ..generation import ENGINES, BuiltinSettings, ServerConfig, knobs
from ..harness.typed_yaml import to_plain

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "EVAL_SECTIONS",
    "SECTION_TYPES",
    "EvalConfig",
    "defaults",
    "eval_engines",
    "save_eval_config",
]


DEFAULT_MAX_NEW_TOKENS = 32768  # the InfiR2 evaluation budget (its 32k context): reasoning is long


def _key(default: Any, meaning: str, flag: str | None = None) -> Any:
    """A field with its default, its meaning (``infir2 config --keys``) and its flag (``eval_argv``; None:
    ``--`` and the field's name with dashes)."""
    return field(default=default, metadata={"help": meaning, "flag": flag})


@dataclass(frozen=True, kw_only=True)
class EvalRun:
    out: str = _key("eval_out", "output folder; a rerun into the same folder resumes")
    seed: int = _key(0, "sampling seed (one seed per sample is drawn from it)")


@dataclass(frozen=True, kw_only=True)
class EvalModel:
    path: str = _key(
        "", "checkpoint folder (HF, or FP8 from `infir2 export`); server: the served name", "--model"
    )
    tokenizer: str | None = _key(None, "tokenizer folder that renders the prompts; null: model.path")


@dataclass(frozen=True, kw_only=True)
class EvalGeneration:
    engine: str = _key("builtin", "a name in infir2.generation.ENGINES")
    precision: Literal["high", "fp8", "recipe"] = _key(
        "high", "what the engine computes with (generation.PRECISIONS); the engine applies fp8 and recipe"
    )
    recipe: str | None = _key(
        None, "precision recipe: the training recipe the engine converts the model with"
    )
    scale_encoding: Literal["pow2", "fp32"] = _key("pow2", "precision fp8: the export's block scales")
    device: str = _key("auto", "in-process engines: cpu, cuda, cuda:1 ... (auto: cuda if available)")
    batch_size: int = _key(8, "in-process engines: sequences generated (or loss windows scored) together")


@dataclass(frozen=True, kw_only=True)
class EvalBenchmark:
    preset: str | None = _key(None, "the authors' protocol of a benchmark (eval.presets.PRESETS)")
    task: str = _key("math", "answer format, a task of infir2.tasks.TASKS")
    data: str | None = _key(None, "benchmark JSONL; null: the shipped sample of the task")
    limit: int | None = _key(None, "only the first LIMIT problems; null: all")
    n: int = _key(1, "samples per problem (avg@n, pass@k)")
    system_prompt: str | None = _key(
        SYSTEM_PROMPT, "system turn of every prompt; null: none", "--system-prompt"
    )
    think_prefix: str = _key(THINK_PREFIX, "text that opens the assistant turn ('': none)", "--think-prefix")


@dataclass(frozen=True, kw_only=True)
class EvalSampling:
    greedy: bool = _key(False, "greedy decoding (n must be 1)")
    temperature: float = _key(0.65, "sampling temperature")
    top_p: float = _key(0.95, "nucleus sampling threshold")
    max_new_tokens: int = _key(DEFAULT_MAX_NEW_TOKENS, "generation budget per sample")
    max_new_tokens_from: str = _key(
        "the default",
        "where max_new_tokens came from (--max-new-tokens, a preset, the default): a budget past the "
        "model's positions is refused when asked for, said in a warning otherwise",
        "",
    )
    beyond_context: bool = _key(False, "in-process engines: run past max_position_embeddings")


#: the server engine's own defaults (``generation.ServerConfig``): the server section's
_SERVER = {f.name: f.default for f in fields(ServerConfig)}


@dataclass(frozen=True, kw_only=True)
class EvalServer:
    base_url: str | None = _key(None, "engine server: the server, e.g. http://127.0.0.1:8000")
    concurrency: int = _key(_SERVER["concurrency"], "engine server: requests in flight")
    request_timeout: float = _key(_SERVER["timeout_s"], "engine server: seconds one request may take")
    retries: int = _key(
        _SERVER["retries"], "engine server: retries after a connection error, timeout, 429 or 5xx"
    )
    samples_per_request: int | None = _key(
        _SERVER["samples_per_request"], "engine server: samples per request; null: all of a problem's"
    )
    api_key: str | None = _key(_SERVER["api_key"], "engine server: sent as 'Authorization: Bearer KEY'")
    extra_body: dict[str, Any] | None = field(
        default=None, metadata={"help": "engine server: JSON merged into every request", "flag": None}
    )


@dataclass(frozen=True, kw_only=True)
class EvalLoss:
    tokens_dir: str | None = _key(
        None, "held-out loss instead of a benchmark: val.bin + meta.json", "--perplexity"
    )
    split: str = _key("val", "token file name without .bin")
    seq_len: int = _key(1024, "context per window")
    max_windows: int | None = _key(None, "score only the first N windows; null: all")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    run: EvalRun = field(default_factory=EvalRun)
    model: EvalModel = field(default_factory=EvalModel)
    generation: EvalGeneration = field(default_factory=EvalGeneration)
    benchmark: EvalBenchmark = field(default_factory=EvalBenchmark)
    sampling: EvalSampling = field(default_factory=EvalSampling)
    server: EvalServer = field(default_factory=EvalServer)
    loss: EvalLoss = field(default_factory=EvalLoss)
    #: generation.engine's own settings (its registry entry's settings type; the builtin engine has none)
    engine: Any = field(default_factory=BuiltinSettings)


#: section name -> its type
SECTION_TYPES: dict[str, Any] = {
    "run": EvalRun,
    "model": EvalModel,
    "generation": EvalGeneration,
    "benchmark": EvalBenchmark,
    "sampling": EvalSampling,
    "server": EvalServer,
    "loss": EvalLoss,
}


def defaults(section: type, names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The defaults of a section's fields (``names``; None: all): what a flag left unset takes."""
    return {f.name: f.default for f in fields(section) if names is None or f.name in names}


#: sections only an eval config has: a config with one of them is checked as `infir2 eval` checks it
EVAL_SECTIONS = ("generation", "benchmark", "sampling", "server", "loss")


def eval_engines() -> dict[str, list[Any]]:
    """The registered engines that have settings of their own, each with the fields of its ``engine``
    section (``generation.knobs``): eval's generated flags."""
    return {name: knobs(entry.settings) for name, entry in ENGINES.items() if knobs(entry.settings)}


def save_eval_config(cfg: EvalConfig, path: str | Path) -> None:
    """The config (every key) as YAML; ``load_eval_config`` reads it back unchanged."""
    Path(path).write_text(yaml.safe_dump(to_plain(cfg), sort_keys=False))
