"""The server engine: sampling through an OpenAI-compatible ``/v1/completions`` endpoint (``httpx2``).

vLLM (``vllm serve``), SGLang (``python -m sglang.launch_server``) and ``transformers serve`` all offer
the legacy Completions API, which takes a *raw text* prompt. infir2 renders the prompt itself
(``data.chat.render_prompt``: system prompt, chat template, the assistant turn opened with ``<think>\\n``)
-- exactly the text the built-in engine tokenizes -- so the server applies no template of its own.

One request per (prompt, group of samples)::

    POST {base_url}/completions
    {"model": NAME, "prompt": TEXT, "n": K, "max_tokens": M, "temperature": T, "top_p": P,
     "stop": ["<|im_end|>", "<|endoftext|>"], "seed": S}            # greedy: temperature 0, no top_p

``S`` is the seed of the group's first sample; ``top_k`` is sent when set. A choice with
``finish_reason`` ``"length"`` is a truncated sample. A server may return fewer choices than asked
(``transformers serve`` ignores ``n`` and returns one): the rest is asked for again. The token count of
a sample is the server's ``usage.completion_tokens`` when the response holds one choice, else the local
tokenizer's count of its text (plus the stop token when it finished).

Transport: an ``httpx2.AsyncClient`` on one event loop, at most ``concurrency`` requests in flight (the
server batches them), a timeout per request, and retries with exponential backoff (1, 2, 4 ... s, at
most 60 s, jittered) on connection errors, timeouts, 429 and 5xx. Other 4xx answers (a wrong model
name, a rejected field) are not retried. Every failure ends as a one-line ``ServerError``; the first one
cancels the requests in flight (so does Ctrl-C), and what was handed to ``on_done`` stays with the caller.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2
from torch import nn
from tqdm.auto import tqdm

from ..data.chat import STOP_TOKENS
from .base import OnSample, Prompt, Request, Sample, SamplingConfig

__all__ = ["ServerConfig", "ServerEngine", "ServerError", "check_server", "complete", "normalize_base_url"]

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
MAX_BACKOFF_S = 60.0


class ServerError(RuntimeError):
    """A failure talking to the server, as one line (what failed, where, what to do)."""


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Where and how to reach the server; ``extra_body`` is merged into every request (engine extensions).
    The server engine's settings, built from eval's server flags (``eval.engine_flags``)."""

    base_url: str
    model: str
    concurrency: int = 8
    timeout_s: float = 3600.0  # one request may generate tens of thousands of tokens
    retries: int = 8
    backoff_s: float = 1.0
    samples_per_request: int | None = None  # None: all samples of a prompt in one request
    api_key: str | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.retries < 0 or not self.timeout_s > 0 or self.backoff_s < 0:
            raise ValueError(
                f"need concurrency >= 1, retries >= 0, timeout > 0, backoff >= 0; got {self.concurrency}, "
                f"{self.retries}, {self.timeout_s}, {self.backoff_s}"
            )
        if self.samples_per_request is not None and self.samples_per_request < 1:
            raise ValueError(f"samples_per_request must be >= 1, got {self.samples_per_request}")
        object.__setattr__(self, "base_url", normalize_base_url(self.base_url))


def normalize_base_url(url: str) -> str:
    """``http://host:8000``, ``http://host:8000/`` and ``http://host:8000/v1`` -> ``http://host:8000/v1``."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {url!r}")
    return url if url.endswith("/v1") else url + "/v1"


# -------------------------------------------------------------------------------------- one request


class _Retryable(Exception):
    pass


#: seconds the start-up check (``GET /models``) waits for an answer: a listing is instant on a live server,
#: so a server that accepts the connection and never answers is said within this, not after the whole
#: --request-timeout a long generation may need
STARTUP_TIMEOUT_S = 30.0


def _client(cfg: ServerConfig, timeout_s: float | None = None) -> httpx2.AsyncClient:
    headers = {"Accept": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    limits = httpx2.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    timeout = cfg.timeout_s if timeout_s is None else timeout_s
    return httpx2.AsyncClient(headers=headers, timeout=timeout, limits=limits)


async def _request(client: httpx2.AsyncClient, cfg: ServerConfig, path: str, body: Mapping | None) -> Any:
    """One HTTP exchange; raises ``_Retryable`` (connection, timeout, 429 / 5xx) or ``ServerError``."""
    url = cfg.base_url + path
    try:
        resp = await (client.get(url) if body is None else client.post(url, json=body))
    except httpx2.TransportError as e:  # refused, reset, timed out, cut off
        raise _Retryable(f"cannot reach {url} ({e or type(e).__name__})") from None
    if resp.status_code >= 400:
        detail = _detail(resp.content)
        if resp.status_code in RETRY_STATUS:
            raise _Retryable(f"HTTP {resp.status_code} from {url}: {detail}")
        raise ServerError(
            f"the server at {cfg.base_url} refused {path} with HTTP {resp.status_code}: {detail}"
        )
    try:
        return resp.json()
    except ValueError:
        raise ServerError(f"{url} answered with something that is not JSON: {resp.content[:120]!r}") from None


def _detail(payload: bytes) -> str:
    """The server's error message (OpenAI ``{"error": {"message"}}``, FastAPI ``{"detail"}``) on one line."""
    text = payload.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            err = obj.get("error")
            text = str(err.get("message", err) if isinstance(err, dict) else err or obj.get("detail") or obj)
    except json.JSONDecodeError:
        pass
    return " ".join(text.split())[:300] or "(empty body)"


async def _with_retries(
    client: httpx2.AsyncClient, cfg: ServerConfig, path: str, body: Mapping | None, retries: int
) -> Any:
    for attempt in range(retries + 1):
        try:
            return await _request(client, cfg, path, body)
        except _Retryable as e:
            if attempt == retries:
                tries = f"{retries + 1} tries" if retries else "1 try"
                raise ServerError(
                    f"{e} after {tries}; is the server up at --base-url {cfg.base_url}?"
                ) from None
            delay = min(MAX_BACKOFF_S, cfg.backoff_s * 2**attempt)
            await asyncio.sleep(delay * (0.5 + random.random() / 2))  # jitter: failed together, retry apart
    raise AssertionError("unreachable")


def check_server(cfg: ServerConfig) -> list[str]:
    """The models the server lists (``GET /models``); one-line ``ServerError`` if unreachable or ``cfg.model`` is not served."""

    wait = min(cfg.timeout_s, STARTUP_TIMEOUT_S)

    async def listing() -> Any:
        async with _client(cfg, wait) as client:
            return await _with_retries(client, cfg, "/models", None, retries=min(cfg.retries, 1))

    log.info("asking %s/models which models it serves (waiting up to %.0f s)", cfg.base_url, wait)
    found = asyncio.run(listing())
    try:
        served = [str(m["id"]) for m in found["data"]]
    except (KeyError, TypeError):
        raise ServerError(f"{cfg.base_url}/models is not an OpenAI model list: {str(found)[:120]}") from None
    if cfg.model not in served:
        raise ServerError(
            f"the server at {cfg.base_url} serves {', '.join(map(repr, served)) or 'no model'}, not {cfg.model!r} "
            f"(--model must be the served model name)"
        )
    return served


def _body(
    cfg: ServerConfig, prompt: str, n: int, sampling: SamplingConfig, stop: Sequence[str], seed: int
) -> dict:
    body: dict[str, Any] = {
        "model": cfg.model,
        "prompt": prompt,
        "n": n,
        "max_tokens": sampling.max_new_tokens,
        "stop": list(stop),
        "seed": seed,
    }
    if sampling.greedy:
        body["temperature"] = 0.0
    else:
        body.update(temperature=sampling.temperature, top_p=sampling.top_p)
        if sampling.top_k:
            body["top_k"] = sampling.top_k
    body.update(cfg.extra_body)
    return body


async def _complete(
    client: httpx2.AsyncClient,
    cfg: ServerConfig,
    prompt: str,
    n: int,
    sampling: SamplingConfig,
    stop: Sequence[str],
    seed: int,
    count_tokens: Callable[[str], int],
) -> list[Sample]:
    resp = await _with_retries(
        client, cfg, "/completions", _body(cfg, prompt, n, sampling, stop, seed), cfg.retries
    )
    try:
        choices = sorted(resp["choices"], key=lambda c: c.get("index", 0))
        usage = (resp.get("usage") or {}).get("completion_tokens")
        out = []
        for c in choices[:n]:
            finished = c.get("finish_reason") != "length"
            text = c["text"]
            tokens = int(usage) if len(choices) == 1 and usage is not None else count_tokens(text) + finished
            out.append(Sample([], [], finished, text=text, n_tokens=tokens))
    except (KeyError, TypeError, AttributeError, ValueError):
        raise ServerError(
            f"{cfg.base_url}/completions answered without choices[].text: {str(resp)[:160]}"
        ) from None
    if not out:
        raise ServerError(f"{cfg.base_url}/completions answered with no choices")
    return out


def complete(cfg: ServerConfig, *args: Any) -> list[Sample]:
    """``_complete`` outside an event loop, on a client of its own: ``complete(cfg, prompt, n, sampling,
    stop, seed, count_tokens)`` -> up to ``n`` samples of ``prompt`` from one request (with retries)."""

    async def one() -> list[Sample]:
        async with _client(cfg) as client:
            return await _complete(client, cfg, *args)

    return asyncio.run(one())


# ------------------------------------------------------------------------------------ many requests

#: ``on_done(prompt index, sample index, sample)``


async def _generate_all(
    cfg: ServerConfig,
    prompts: Sequence[Prompt],
    sampling: SamplingConfig,
    stop: Sequence[str],
    count_tokens: Callable[[str], int],
    on_done: OnSample,
) -> None:
    """Every sample of ``prompts``, at most ``cfg.concurrency`` requests in flight. A request asks for up to
    ``cfg.samples_per_request`` of a prompt's missing samples (seeded with the first one's seed); what
    comes back fills the lowest missing indices and the rest is asked for again."""
    per_request = cfg.samples_per_request
    todo = deque((i, tuple(range(len(p.seeds)))) for i, p in enumerate(prompts) if p.seeds)
    running: dict[asyncio.Task, tuple[int, tuple[int, ...]]] = {}
    async with _client(cfg) as client:
        try:
            while todo or running:
                while todo and len(running) < cfg.concurrency:
                    i, missing = todo.popleft()
                    k = len(missing) if per_request is None else min(per_request, len(missing))
                    text, seed = prompts[i].text or "", prompts[i].seeds[missing[0]]
                    call = _complete(client, cfg, text, k, sampling, stop, seed, count_tokens)
                    running[asyncio.create_task(call)] = (i, missing)
                finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    i, missing = running.pop(task)
                    got = task.result()  # a ServerError propagates
                    for j, sample in zip(missing, got, strict=False):
                        on_done(i, j, sample)
                    if rest := missing[len(got) :]:
                        todo.appendleft((i, rest))
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)


class ServerEngine:
    """An OpenAI-compatible ``/v1/completions`` server (vLLM, SGLang, ``transformers serve``): text out."""

    label = "as served"  # what a server loaded: infir2 cannot see it
    returns_ids = False

    def __init__(self, server: ServerConfig, tokenizer, name: str = "server") -> None:
        self.server, self.tokenizer, self.name = server, tokenizer, name
        self.extra_body = dict(server.extra_body)  # part of the settings a resumed run must match
        self.stop = [t for t in STOP_TOKENS if t in tokenizer.get_vocab()]
        if tokenizer.eos_token and tokenizer.eos_token not in self.stop:
            self.stop.append(tokenizer.eos_token)

    def load_weights(self, policy: nn.Module) -> None:
        raise NotImplementedError("the server engine serves the weights it loaded")

    def _count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(self, request: Request) -> list[list[Sample]]:
        prompts = request.prompts
        if any(p.text is None for p in prompts):
            raise ValueError("the server engine takes prompt texts (Prompt.text), not only token ids")
        out: list[dict[int, Sample]] = [{} for _ in prompts]
        total = sum(len(p.seeds) for p in prompts)
        with tqdm(total=total, desc=self.name, unit="sample", disable=not request.progress) as bar:

            def done(i: int, j: int, sample: Sample) -> None:
                out[i][j] = sample
                bar.update(1)
                request.done(i, j, sample)

            sampling = request.sampling
            asyncio.run(_generate_all(self.server, prompts, sampling, self.stop, self._count_tokens, done))
        return [[got[j] for j in sorted(got)] for got in out]
