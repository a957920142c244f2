"""`infir2 eval --engine server`: the transport (retries, one-line errors) and resuming, against a scripted server.

The server here is a small stdlib HTTP server in a thread, bound to a free port on 127.0.0.1, that
speaks the OpenAI Completions API and can be told to fail (429 / 503, another model, dropping the
`n` field like `transformers serve`). The greedy equality with the builtin engine and the kill /
restart test run against a real `transformers serve` in `test_eval_server_real.py`.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from infir2.cli import main
from infir2.eval.completions import COMPLETIONS_FILE
from infir2.generation import SamplingConfig
from infir2.generation.server import ServerConfig, ServerError, complete, normalize_base_url

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.transformers_api,
]  # transformers_api: CI runs it again on the floor


@dataclass
class Script:
    """What the scripted server does: ``fail`` holds HTTP statuses to answer the next completion requests with."""

    model: str = "fake"
    fail: list[int] = field(default_factory=list)
    honour_n: bool = True
    requests: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, body: dict) -> tuple[int, dict]:
        with self.lock:
            self.requests.append(body)
            if self.fail:
                return self.fail.pop(0), {"error": {"message": "scripted failure"}}
        if body.get("model") != self.model:
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}}
        # the answer is the length of the user turn, boxed: graded right for "problem" texts of that length
        question = re.search(r"user\n(.*?)<\|im_end\|>", body["prompt"], re.DOTALL)
        text = f"thinking</think> \\boxed{{{len(question.group(1)) if question else -1}}}"
        k = body.get("n", 1) if self.honour_n else 1
        choices = [{"index": i, "text": text, "finish_reason": "stop"} for i in range(k)]
        return 200, {"choices": choices, "usage": {"completion_tokens": 7 * k}}


@pytest.fixture
def server() -> Iterator[tuple[str, Script]]:
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _send(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": script.model, "object": "model"}]})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._send(*script.answer(body))

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", script
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def tok_dir(tmp_path: Path, tiny_tokenizer) -> Path:
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


@pytest.fixture
def problems(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    texts = ["abc", "hello", "x" * 12, "seven", "1+1=?"]
    path.write_text(
        "".join(
            json.dumps({"problem": t, "answer": str(len(t)), "id": f"q{i}"}) + "\n"
            for i, t in enumerate(texts)
        )
    )
    return path


def _argv(url: str, tok_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "eval",
        "--engine",
        "server",
        "--base-url",
        url,
        "--model",
        "fake",
        "--tokenizer",
        str(tok_dir),
        "--data",
        str(data),
        "--out",
        str(out),
        "--max-new-tokens",
        "16",
        *extra,
    ]


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / COMPLETIONS_FILE).read_text().splitlines()]


def test_scores_resume_and_refuse_changed_settings(
    server, tok_dir: Path, problems: Path, tmp_path: Path, tiny_tokenizer, capsys
) -> None:
    url, script = server
    out = tmp_path / "out"
    assert main(_argv(url, tok_dir, problems, out, "--n", "3", "--limit", "2")) == 0
    assert len(script.requests) == 2 and {r["n"] for r in script.requests} == {3}  # one request per problem
    body = script.requests[0]
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.65, 0.95, 16)
    assert body["stop"] == ["<|im_end|>", "<|endoftext|>"]
    assert body["prompt"].endswith("<|im_start|>assistant\n<think>\n")
    # the rest of the problems, and a fourth sample each: only what is missing is asked for
    assert main(_argv(url, tok_dir, problems, out, "--n", "4")) == 0
    asked = sorted(r["n"] for r in script.requests[2:])
    assert asked == [1, 1, 4, 4, 4]
    lines = _lines(out)
    assert sorted((r["id"], r["sample"]) for r in lines) == [(f"q{i}", s) for i in range(5) for s in range(4)]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["avg@n"], summary["samples"], summary["generated_now"]) == (1.0, 20, 14)
    assert summary["engine"] == "server"
    # token counts: the server's usage for a one-choice answer (7), else the local tokenizer's count + the stop token
    counted = len(tiny_tokenizer(lines[0]["completion"], add_special_tokens=False)["input_ids"]) + 1
    assert sorted({r["n_tokens"] for r in lines}) == [7, counted]
    # another sampling setting in the same folder is refused, naming the key
    capsys.readouterr()
    assert main(_argv(url, tok_dir, problems, out, "--n", "4", "--temperature", "0.7")) == 2
    assert "temperature: 0.65 -> 0.7" in capsys.readouterr().err
    assert main(_argv(url, tok_dir, problems, out, "--n", "4", "--no-system-prompt")) == 2
    assert "system_prompt:" in capsys.readouterr().err
    # a partial last line (a killed run) is cut off, and that sample is generated again
    raw = (out / COMPLETIONS_FILE).read_bytes()
    (out / COMPLETIONS_FILE).write_bytes(raw + raw.splitlines(keepends=True)[0][:25])
    before = len(script.requests)
    assert main(_argv(url, tok_dir, problems, out, "--n", "4")) == 0
    assert len(script.requests) == before and len(_lines(out)) == 20  # nothing missing, nothing re-asked


def test_a_server_that_ignores_n_is_asked_again(
    server, tok_dir: Path, problems: Path, tmp_path: Path
) -> None:
    url, script = server
    script.honour_n = False  # transformers serve returns one choice whatever n says
    assert main(_argv(url, tok_dir, problems, tmp_path / "o", "--n", "3", "--limit", "2")) == 0
    assert sorted(r["n"] for r in script.requests) == [1, 1, 2, 2, 3, 3]
    assert len(_lines(tmp_path / "o")) == 6


def test_prompt_flags_reach_the_request(server, tok_dir: Path, problems: Path, tmp_path: Path) -> None:
    url, script = server

    def run(out: str, *flags: str) -> int:
        return main(_argv(url, tok_dir, problems, tmp_path / out, "--greedy", "--limit", "1", *flags))

    assert run("o", "--no-system-prompt", "--no-think-prefix", "--extra-body", '{"top_k": -1}') == 0
    body = script.requests[0]
    assert body["prompt"] == "<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n"
    assert body["temperature"] == 0.0 and "top_p" not in body and body["top_k"] == -1
    assert run("o2", "--system-prompt", "Be brief.", "--think-prefix", "<t>") == 0
    assert script.requests[1]["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert script.requests[1]["prompt"].endswith("assistant\n<t>")


def test_retries_on_429_and_5xx_then_gives_a_one_line_error(server, tiny_tokenizer) -> None:
    url, script = server
    cfg = ServerConfig(base_url=url, model="fake", retries=3, backoff_s=0.01)
    sampling = SamplingConfig(greedy=True, max_new_tokens=4)
    script.fail = [429, 503, 502]
    got = complete(cfg, "<|im_start|>user\nabc<|im_end|>\n", 1, sampling, ["<|im_end|>"], 0, len)
    assert got[0].text.endswith("\\boxed{3}") and got[0].n_tokens == 7 and got[0].finished
    assert len(script.requests) == 4
    script.fail = [503] * 4
    with pytest.raises(
        ServerError, match=r"^HTTP 503 from .*/v1/completions: scripted failure after 4 tries"
    ):
        complete(cfg, "p", 1, sampling, [], 0, len)
    script.fail = [400]  # a 4xx other than 429 is not retried
    with pytest.raises(ServerError, match="refused /completions with HTTP 400: scripted failure"):
        complete(cfg, "p", 1, sampling, [], 0, len)
    assert len(script.requests) == 9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_errors_are_one_line(server, tok_dir: Path, problems: Path, tmp_path: Path, capsys) -> None:
    url, script = server
    dead = f"http://127.0.0.1:{_free_port()}"
    cases = [
        (
            _argv(dead, tok_dir, problems, tmp_path / "a", "--retries", "0"),
            1,
            r"cannot reach http://127\.0\.0\.1:\d+/v1/models .* after 1 try",
        ),
        (
            [*_argv(url, tok_dir, problems, tmp_path / "b"), "--model", "other"],
            1,
            r"serves 'fake', not 'other'",
        ),
        (
            _argv(url, tok_dir, problems, tmp_path / "c", "--retries", "1", "--limit", "1"),
            1,
            r"HTTP 503 .* after 2 tries",
        ),
        (
            ["eval", "--engine", "server", "--model", "fake", "--tokenizer", str(tok_dir)],
            2,
            r"needs --base-url",
        ),
        (_argv("localhost:8000", tok_dir, problems, tmp_path / "d"), 2, r"must start with http://"),
        (
            ["eval", "--engine", "server", "--base-url", url, "--model", "fake"],
            2,
            r"needs --tokenizer FOLDER",
        ),
        (
            _argv(url, tok_dir, problems, tmp_path / "e", "--preset", "gpqa-diamond", "--task", "math"),
            2,
            "is a multiple_choice benchmark",
        ),
        (["eval", "--model", "m", "--preset", "aime24"], 2, "needs --data"),
    ]
    for argv, code, message in cases:
        script.fail = [503] * 2
        assert main(argv) == code, argv
        captured = capsys.readouterr()
        text = (captured.out + captured.err).strip()
        error_lines = [line for line in text.splitlines() if line.startswith("infir2 eval: error:")]
        assert len(error_lines) == 1 and re.search(message, error_lines[0]), (message, text)
        script.fail = []


def test_preset_sets_the_protocol_and_flags_override_it(
    server, tok_dir: Path, problems: Path, tmp_path: Path
) -> None:
    url, script = server
    assert (
        main(_argv(url, tok_dir, problems, tmp_path / "o", "--preset", "aime24", "--n", "2", "--limit", "1"))
        == 0
    )
    body = script.requests[0]
    assert (body["n"], body["temperature"], body["top_p"], body["max_tokens"]) == (2, 0.65, 0.95, 16)
    argv = _argv(url, tok_dir, problems, tmp_path / "p", "--preset", "aime25", "--limit", "1")
    argv.remove("--max-new-tokens"), argv.remove("16")
    assert main(argv) == 0
    assert script.requests[1]["max_tokens"] == 31000 and script.requests[1]["n"] == 32


def test_base_url_forms() -> None:
    assert {normalize_base_url(u) for u in ("http://h:8000", "http://h:8000/", "http://h:8000/v1/")} == {
        "http://h:8000/v1"
    }


def test_a_changed_problem_text_is_refused(
    server, tok_dir: Path, problems: Path, tmp_path: Path, capsys
) -> None:
    url, _ = server
    out = tmp_path / "o"
    assert main(_argv(url, tok_dir, problems, out, "--limit", "2")) == 0
    problems.write_text(problems.read_text().replace('"hello"', '"hullo"'))
    capsys.readouterr()
    assert main(_argv(url, tok_dir, problems, out)) == 2
    assert "prompts of problem(s) ['q1'] differ" in capsys.readouterr().err


def test_settings_bind_only_once_a_sample_is_saved(
    server, tok_dir: Path, problems: Path, tmp_path: Path
) -> None:
    url, script = server
    out = tmp_path / "o"
    script.fail = [400]  # the first run fails before any sample is saved
    assert main(_argv(url, tok_dir, problems, out, "--limit", "1")) == 1
    assert main(_argv(url, tok_dir, problems, out, "--limit", "1", "--temperature", "0.7")) == 0
    assert json.loads((out / "eval_config.json").read_text())["settings"]["temperature"] == 0.7


def test_a_server_that_never_answers_is_said_within_the_startup_timeout(
    tok_dir: Path, problems: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """The connection is accepted and no byte ever comes back: the start-up check gives up after its own
    short timeout (here 1 s), not after --request-timeout (3600 s by default)."""
    import time

    from infir2.generation import server as server_module

    monkeypatch.setattr(server_module, "STARTUP_TIMEOUT_S", 1.0)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts (the kernel completes the handshake) and never answers
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        assert main(_argv(url, tok_dir, problems, tmp_path / "o", "--retries", "0")) == 1
        assert time.monotonic() - start < 20
    finally:
        silent.close()
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("infir2 eval: error:")]


def test_a_failure_mid_run_is_one_line_with_what_is_saved(
    server, tok_dir: Path, problems: Path, tmp_path: Path, capsys
) -> None:
    url, script = server
    out = tmp_path / "o"
    assert (
        main(_argv(url, tok_dir, problems, out, "--retries", "0", "--limit", "2", "--concurrency", "1")) == 0
    )
    script.fail = [503]  # the next request fails: the server went away
    capsys.readouterr()
    assert main(_argv(url, tok_dir, problems, out, "--retries", "0", "--concurrency", "1")) == 1
    bar = "sample/s]"  # the progress bar's lines
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and bar not in line]
    assert len(err) == 1 and err[0].startswith("infir2 eval: error:"), err  # before: an ERROR log line too
    assert "2 samples are saved in" in err[0] and "rerun the same command" in err[0]
