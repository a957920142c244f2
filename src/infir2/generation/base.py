"""What every engine speaks: a prompt with one seed per wanted sample in, samples out.

An engine (``Engine``) is asked for samples of prompts (a ``Request``: the prompts, the sampling settings,
who hears of each finished sample), never for "a batch": ``Prompt.seeds`` holds one
seed per sample, and sample j of a prompt is drawn from ``seeds[j]`` alone, so what a prompt gets does
not depend on the other prompts of the call, on the batch size or on the rank that asked (an engine
that honours seeds; the batched forward may still change a log-probability at float rounding). An
engine returns for each sample the response token ids (the stop token included when it stopped) and
the engine's log-probability of each (``returns_ids``), or, from a text API, the response text.

``infir2 eval`` and ``infir2 rl`` both build their engine by name from ``generation.registry.ENGINES``;
RL talks to it through ``RolloutEngine`` (``n`` samples per prompt from one seed per prompt).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

import torch
from torch import nn

from ..data.chat import stop_token_ids

__all__ = [
    "PRECISIONS",
    "Engine",
    "EngineOptions",
    "OnSample",
    "Preview",
    "Prompt",
    "Request",
    "RolloutEngine",
    "Sample",
    "SamplingConfig",
    "check_prompt_fits",
    "derive_seeds",
    "knob",
    "knobs",
    "stops_and_pad",
]


#: what an engine computes with, one word for config keys, flags and engines alike (``rollout.precision``,
#: ``infir2 eval --precision``, ``EngineOptions.precision``), and what each means
PRECISIONS: dict[str, str] = {
    "high": "no FP8: the model's high precision (its dtype is model precision / base dtype, not this word)",
    "fp8": "the FP8 export's weights as deployed: its FP8 codes and 128x128 block scales, 1x128 activations",
    "recipe": "a training recipe's FP8 forward through the model's Fp8Linear layers (needs a recipe name)",
}


def knob(default: Any, meaning: str) -> Any:
    """A field of an engine's settings (a ``kw_only`` dataclass) with its default and meaning: the one
    declaration that RL's ``engine`` section and ``infir2 eval``'s generated flags are read from."""
    return field(default=default, metadata={"help": meaning})


def knobs(settings: type | None) -> list[Any]:
    """The knobs of a settings type (its fields declared with ``knob``); [] for None or a type whose
    fields are set by the caller (a server's ``ServerConfig``, built from eval's own flags)."""
    if settings is None:
        return []
    found = fields(settings)
    return list(found) if all("help" in f.metadata for f in found) else []


def stops_and_pad(tokenizer) -> tuple[list[int], int]:
    """The stop ids (``data.chat.stop_token_ids``, sorted) and the pad id (the tokenizer's, else the first
    stop id): the one rule for every padded batch of generated text (the sampler's and RL's)."""
    stops = sorted(set(stop_token_ids(tokenizer)))
    if not stops:
        raise ValueError("the tokenizer has neither <|im_end|> nor an eos token: generation could never stop")
    pad = tokenizer.pad_token_id
    return stops, pad if pad is not None else stop_token_ids(tokenizer)[0]


def check_prompt_fits(longest: int, limit: int | None, beyond_context: bool = False) -> None:
    """A prompt of ``longest`` tokens must leave a position to generate in, of the model's ``limit``
    (``max_position_embeddings``); ``beyond_context``: run past them (RoPE extrapolation)."""
    if limit is not None and longest >= limit and not beyond_context:
        raise ValueError(
            f"a prompt of {longest} tokens does not fit the model's {limit} positions (max_position_embeddings): "
            "shorten the problems, or pass --beyond-context (eval) / set model.beyond_context (rl) to run past them"
        )


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """What every engine is built from: ``infir2 eval``'s config, or the RL config and its policy."""

    tokenizer: Any
    model: Callable[[], nn.Module] | None = (
        None  # in-process engines call it (eval loads, RL hands the policy)
    )
    precision: str = "high"  # a word of PRECISIONS: high | fp8 (the FP8 export's weights) | recipe
    recipe: str | None = None  # recipe: the training recipe the engine converts the model's projections with
    scale_encoding: str = "pow2"  # fp8: the export's block scales (pow2 | fp32)
    model_dir: str | None = None  # eval: the --model folder, for an engine that reads it itself (vllm)
    device: str | None = None  # eval: --device (None: the engine's own choice; vllm places the model itself)
    model_precision: str | None = None  # RL: model.precision, the autocast of the high-precision parts
    copy_model: bool = False  # RL: generate from a copy that load_weights(policy) refreshes
    base_dtype: torch.dtype | None = None  # fp8 + copy_model: the other tensors as the FP8 export holds them
    record_routes: bool = False  # RL's routing replay: each sample's MoE experts per token (Sample.routes)
    exact: bool = False  # RL's rollout.exact: decode with exact numerics (nn.exact; the builtin engine)


@dataclass(frozen=True)
class Preview:
    """What an engine will report, known before it is built (eval's settings, which a resume must match)."""

    label: str  # its ``Engine.label``
    served_dtype: str | None = None  # the dtype it serves in, where that is not the folder's (vllm)


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """Decoding settings. ``greedy`` ignores temperature / top_p / top_k; ``top_k`` 0 = no top-k.

    The defaults are the InfiR2 evaluation protocol (0.65 / 0.95); RL samples the policy itself
    (``top_p`` 1, ``top_k`` 0), so the trainer's log-probabilities compare with the engine's.
    """

    greedy: bool = False
    temperature: float = 0.65
    top_p: float = 0.95
    max_new_tokens: int = 1024
    batch_size: int = 8  # sequences an in-process engine generates together
    top_k: int = 0
    # an in-process engine stops each sequence at the model's trained positions (max_position_embeddings;
    # such a sample is unfinished) and refuses a longer prompt; True: run past them (RoPE extrapolation)
    beyond_context: bool = False

    def __post_init__(self) -> None:
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError(
                f"max_new_tokens and batch_size must be >= 1, got {self.max_new_tokens}, {self.batch_size}"
            )


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, its text (what a text API is sent; None: ids only), a seed per sample."""

    ids: list[int]
    text: str | None
    seeds: tuple[int, ...]


@dataclass
class Sample:
    """One sampled response.

    ``response_ids`` includes the stop token when it stopped (``[]`` from an engine that returns text
    only); ``logprobs`` the engine's log-probability of each (``softmax(logits / temperature)``, before
    any top-p / top-k); ``text`` the engine's own text of it (a server's, without the stop token);
    ``n_tokens`` the engine's count when it returns no ids; ``routes`` the experts each token went to
    (an engine asked to record them: ``nn.moe.routing``).
    """

    response_ids: list[int]
    logprobs: list[float]
    finished: bool  # stopped at a stop token (False: cut at max_new_tokens)
    text: str | None = None
    n_tokens: int | None = field(default=None)
    # routing replay: [prompt + response tokens, MoE layers, k] int16 expert ids the engine chose (-1: none
    # recorded, as for the last response token, which no forward is fed); None: not recorded, or dense
    routes: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.n_tokens if self.n_tokens is not None else len(self.response_ids)


#: ``on_sample(prompt index, sample index, sample)``, called as each sample is finished
OnSample = Callable[[int, int, Sample], None]


@dataclass(frozen=True)
class Request:
    """What an engine is asked: the prompts, how to sample them, who hears of each finished sample
    (``on_sample``, as it is finished), and whether to show a progress bar."""

    prompts: Sequence[Prompt]
    sampling: SamplingConfig
    on_sample: OnSample | None = None
    progress: bool = False

    def done(self, i: int, j: int, sample: Sample) -> None:
        """Hand prompt ``i``'s sample ``j`` to ``on_sample`` (if any)."""
        if self.on_sample is not None:
            self.on_sample(i, j, sample)


class Engine(Protocol):
    """Where samples come from. ``name`` is its registry name, ``label`` what its projections run in, as
    eval's settings and summary say it (it starts with one of ``PRECISIONS``' words, or says what a
    server loaded); the word itself is ``EngineOptions.precision``."""

    name: str
    label: str
    returns_ids: bool  # response ids and log-probabilities (what RL trains on); False: text only

    def load_weights(self, policy: nn.Module) -> None:
        """Take new weights (RL, after every update); every rank calls it."""
        ...

    def generate(self, request: Request) -> list[list[Sample]]:
        """``result[i][j]``: prompt i's sample j, drawn from ``request.prompts[i].seeds[j]``."""
        ...


def derive_seeds(seed: int, k: int) -> list[int]:
    """``k`` seeds drawn from ``seed`` (a seeded ``torch.Generator``): the per-prompt and per-sample seeds."""
    return torch.randint(0, 2**62, (k,), generator=torch.Generator().manual_seed(seed)).tolist()


class RolloutEngine:
    """RL's view of an engine: ``n`` samples of each prompt (token ids) from one seed per prompt.

    ``generate(prompts, n, seed, greedy)``: ``seed`` is an int (``derive_seeds(seed, len(prompts))``) or
    one seed per prompt; sample j of prompt i is drawn from ``derive_seeds(seed_i, n)[j]``.
    """

    def __init__(self, engine: Engine, sampling: SamplingConfig) -> None:
        if not engine.returns_ids:
            raise ValueError(
                f"rollout.engine: {engine.name} returns text only; RL trains on the engine's token ids "
                "and log-probabilities"
            )
        self.engine, self.sampling = engine, sampling
        self.refit_s = 0.0  # the last load_weights's seconds (RL's refit_time_s)

    def load_weights(self, policy: nn.Module) -> None:
        start = time.perf_counter()
        self.engine.load_weights(policy)
        self.refit_s = time.perf_counter() - start

    def generate(
        self, prompts: Sequence[list[int]], n: int, seed: int | Sequence[int], greedy: bool = False
    ) -> list[list[Sample]]:
        seeds = derive_seeds(seed, len(prompts)) if isinstance(seed, int) else list(seed)
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
        requests = [Prompt(p, None, tuple(derive_seeds(s, n))) for p, s in zip(prompts, seeds, strict=True)]
        return self.engine.generate(Request(requests, replace(self.sampling, greedy=greedy)))
