"""The server engine of ``infir2 eval``: sampling through an OpenAI-compatible ``/v1/completions`` endpoint.

vLLM (``vllm serve``), SGLang (``python -m sglang.launch_server``) and ``transformers serve`` all offer
the legacy Completions API, which takes a *raw text* prompt. infir2 renders the prompt itself
(``data.chat.render_prompt``: system prompt, chat template, the assistant turn opened with ``<think>\\n``)
-- exactly the text the local engine tokenizes -- so the server applies no template of its own.

One request per (problem, group of samples)::

    POST {base_url}/completions
    {"model": NAME, "prompt": TEXT, "n": K, "max_tokens": M, "temperature": T, "top_p": P,
     "stop": ["<|im_end|>", "<|endoftext|>"], "seed": S}            # greedy: temperature 0, no top_p

A choice with ``finish_reason`` ``"length"`` is a truncated sample. A server may return fewer choices
than asked (``transformers serve`` ignores ``n`` and returns one): the rest is asked for again. The
token count of a sample is the server's ``usage.completion_tokens`` when the response holds one
choice, else the local tokenizer's count of its text (plus the stop token when it finished).

Transport: at most ``concurrency`` requests in flight (daemon worker threads; the server batches them), a
timeout per request, and retries with exponential backoff (1, 2, 4 ... s, at most 60 s) on
connection errors, timeouts, 429 and 5xx. Other 4xx answers (a wrong model name, a rejected field)
are not retried. Every failure ends as a one-line ``ServerError``. Built on ``urllib`` (no client
library to install).
"""

from __future__ import annotations

import http.client
import json
import queue
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from ..data.chat import STOP_TOKENS
from .generate import Completion, SamplingConfig

__all__ = ["ServerConfig", "ServerError", "check_server", "complete", "normalize_base_url", "server_generate"]

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
MAX_BACKOFF_S = 60.0


class ServerError(RuntimeError):
    """A failure talking to the server, as one line (what failed, where, what to do)."""


@dataclass(frozen=True)
class ServerConfig:
    """Where and how to reach the server; ``extra_body`` is merged into every request (engine extensions)."""

    base_url: str
    model: str
    concurrency: int = 8
    timeout_s: float = 3600.0  # one request may generate tens of thousands of tokens
    retries: int = 8
    backoff_s: float = 1.0
    samples_per_request: int | None = None  # None: all samples of a problem in one request
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


def _request(cfg: ServerConfig, path: str, body: Mapping[str, Any] | None) -> Any:
    """One HTTP exchange; raises ``_Retryable`` (connection, timeout, 429 / 5xx) or ``ServerError``."""
    url = cfg.base_url + path
    data = None if body is None else json.dumps(body).encode("utf-8")
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=cfg.timeout_s) as resp:
            payload = resp.read()
    except urllib.error.HTTPError as e:
        detail = _detail(e.read())
        if e.code in RETRY_STATUS:
            raise _Retryable(f"HTTP {e.code} from {url}: {detail}") from None
        raise ServerError(
            f"the server at {cfg.base_url} refused {path} with HTTP {e.code}: {detail}"
        ) from None
    except (OSError, http.client.HTTPException) as e:  # URLError, refused, reset, timeout, cut off
        reason = getattr(e, "reason", e)
        raise _Retryable(f"cannot reach {url} ({reason})") from None
    try:
        return json.loads(payload)
    except json.JSONDecodeError:
        raise ServerError(f"{url} answered with something that is not JSON: {payload[:120]!r}") from None


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


def _with_retries(
    cfg: ServerConfig,
    path: str,
    body: Mapping[str, Any] | None,
    retries: int,
    abort: threading.Event | None = None,
) -> Any:
    for attempt in range(retries + 1):
        try:
            return _request(cfg, path, body)
        except _Retryable as e:
            if attempt == retries:
                tries = f"{retries + 1} tries" if retries else "1 try"
                raise ServerError(
                    f"{e} after {tries}; is the server up at --base-url {cfg.base_url}?"
                ) from None
            delay = min(MAX_BACKOFF_S, cfg.backoff_s * 2**attempt)
            delay *= 0.5 + random.random() / 2  # jitter: workers that failed together retry apart
            if abort is not None and abort.wait(delay):
                raise ServerError("aborted") from None
            if abort is None:
                time.sleep(delay)
    raise AssertionError("unreachable")


def check_server(cfg: ServerConfig) -> list[str]:
    """The models the server lists (``GET /models``); one-line ``ServerError`` if unreachable or ``cfg.model`` is not served."""
    listing = _with_retries(cfg, "/models", None, retries=min(cfg.retries, 1))
    try:
        served = [str(m["id"]) for m in listing["data"]]
    except (KeyError, TypeError):
        raise ServerError(
            f"{cfg.base_url}/models is not an OpenAI model list: {str(listing)[:120]}"
        ) from None
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
    body.update(cfg.extra_body)
    return body


def complete(
    cfg: ServerConfig,
    prompt: str,
    n: int,
    sampling: SamplingConfig,
    stop: Sequence[str],
    seed: int,
    count_tokens: Callable[[str], int],
    abort: threading.Event | None = None,
) -> list[Completion]:
    """Up to ``n`` completions of ``prompt`` from one request (with retries; ``abort`` ends the waiting)."""
    resp = _with_retries(cfg, "/completions", _body(cfg, prompt, n, sampling, stop, seed), cfg.retries, abort)
    try:
        choices = sorted(resp["choices"], key=lambda c: c.get("index", 0))
        usage = (resp.get("usage") or {}).get("completion_tokens")
        out = []
        for c in choices[:n]:
            finished = c.get("finish_reason") != "length"
            text = c["text"]
            tokens = int(usage) if len(choices) == 1 and usage is not None else count_tokens(text) + finished
            out.append(Completion(text=text, n_tokens=tokens, finished=finished))
    except (KeyError, TypeError, AttributeError, ValueError):
        raise ServerError(
            f"{cfg.base_url}/completions answered without choices[].text: {str(resp)[:160]}"
        ) from None
    if not out:
        raise ServerError(f"{cfg.base_url}/completions answered with no choices")
    return out


# ------------------------------------------------------------------------------------ many requests


class _DaemonPool:
    """A fixed set of daemon worker threads: unlike ``ThreadPoolExecutor``'s, a request still in flight
    does not hold the interpreter open at exit (Ctrl-C, or an error in another request)."""

    def __init__(self, workers: int) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(workers):
            threading.Thread(target=self._work, name=f"infir2-eval-{i}", daemon=True).start()
        self._workers = workers

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # handed to the caller through the future
                    fut.set_exception(e)

    def submit(self, fn: Callable, *args: Any) -> Future:
        fut: Future = Future()
        self._queue.put((fn, args, fut))
        return fut

    def shutdown(self) -> None:
        for _ in range(self._workers):
            self._queue.put(None)


@dataclass(frozen=True)
class Job:
    """Samples ``samples`` (their indices) of one prompt, still to be generated."""

    key: str
    prompt: str
    samples: tuple[int, ...]
    seed: int


def server_generate(
    cfg: ServerConfig,
    jobs: Sequence[Job],
    sampling: SamplingConfig,
    tokenizer,
    desc: str = "server",
    progress: bool = True,
) -> Iterator[tuple[str, int, Completion]]:
    """Yield ``(key, sample index, completion)`` as responses arrive, at most ``cfg.concurrency`` requests in flight.

    A request asks for up to ``cfg.samples_per_request`` of a job's samples; what comes back fills
    the lowest missing indices and the rest is asked for again. The first ``ServerError`` stops the
    run (requests in flight are abandoned; what was yielded is kept by the caller).
    """
    stop = [t for t in STOP_TOKENS if t in tokenizer.get_vocab()]
    if tokenizer.eos_token and tokenizer.eos_token not in stop:
        stop.append(tokenizer.eos_token)

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    per_request = cfg.samples_per_request
    todo: list[tuple[Job, tuple[int, ...]]] = [(j, j.samples) for j in jobs if j.samples]
    total = sum(len(s) for _, s in todo)
    pool = _DaemonPool(cfg.concurrency)
    running: dict[Future, tuple[Job, tuple[int, ...]]] = {}
    abort = threading.Event()

    def submit(job: Job, missing: tuple[int, ...]) -> None:
        k = len(missing) if per_request is None else min(per_request, len(missing))
        fut = pool.submit(
            complete, cfg, job.prompt, k, sampling, stop, job.seed + missing[0], count_tokens, abort
        )
        running[fut] = (job, missing)

    try:
        with tqdm(total=total, desc=desc, unit="sample", disable=not progress) as bar:
            while todo or running:
                while todo and len(running) < cfg.concurrency:
                    submit(*todo.pop(0))
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    job, missing = running.pop(fut)
                    got = fut.result()  # a ServerError propagates
                    for index, completion in zip(missing, got, strict=False):
                        yield job.key, index, completion
                    bar.update(min(len(got), len(missing)))
                    rest = missing[len(got) :]
                    if rest:
                        todo.insert(0, (job, rest))
    finally:
        abort.set()  # workers still retrying give up; a request in flight ends with its timeout
        for fut in running:
            fut.cancel()
        pool.shutdown()
