"""Start and stop a real `transformers serve` (the `serving` extra of transformers) for the tests and benchmarks.

It is bound to 127.0.0.1 on a free port, offline (HF_HUB_OFFLINE), on the CPU in fp32, pinned to one
local model folder (so its served name is the folder path as given), and killed on exit.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

_CLI = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; sys.exit(main())"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    url: str
    port: int
    proc: subprocess.Popen
    log: Path

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def have_serving() -> bool:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return False
    return True


needs_serving = pytest.mark.skipif(
    not have_serving(), reason="needs transformers[serving] (fastapi, uvicorn)"
)


@contextmanager
def transformers_serve(
    model_dir: Path,
    log: Path,
    port: int | None = None,
    startup_s: float = 240,
    extra: list[str] | None = None,
) -> Iterator[Served]:
    """A running `transformers serve MODEL_DIR`; fails with the server's log tail when it does not come up."""
    port = port or free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable,
        "-c",
        _CLI,
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--log-level",
        "warning",
        *(extra or []),
    ]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    served = Served(f"http://127.0.0.1:{port}", port, proc, log)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"transformers serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"{served.url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"transformers serve not up after {startup_s} s:\n{log.read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield served
    finally:
        served.kill()
