"""The completions file of an evaluation folder: every finished sample, appended as it arrives, so nothing is lost.

``<out>/completions.jsonl`` holds one line per finished sample::

    {"id": "aime24-3", "sample": 17, "prompt_sha256": "9c1e...", "completion": "...", "finished": true, "n_tokens": 8123}

and ``<out>/eval_config.json`` the settings the samples were drawn with (``settings``: model, engine,
task, prompt, decoding). A rerun of the same command reads both back and generates only the samples
that are missing. A rerun with other settings is refused, naming each changed key
(``temperature: 0.65 -> 0.7``), and so is a problem whose rendered prompt differs from the one its
saved samples answered (changed data, system prompt or chat template): mixing them would score a
different evaluation. Raising ``n`` (or dropping ``--limit``) is fine: the saved samples are kept and
the new ones are asked for.

Each line is written with one ``write`` and flushed (``fsync`` too) before the next sample is taken,
so a killed process leaves at worst one partial last line, which the next run cuts off.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "COMPLETIONS_FILE",
    "CONFIG_FILE",
    "Completion",
    "CompletionLog",
    "SettingsChanged",
    "prompt_sha256",
]

COMPLETIONS_FILE = "completions.jsonl"
CONFIG_FILE = "eval_config.json"

Key = tuple[str, int]  # (problem id, sample index)


@dataclass(frozen=True)
class Completion:
    """One graded sample as evaluation keeps it: the response text (no stop token), its token count."""

    text: str
    n_tokens: int
    finished: bool  # stopped at a stop token (False: cut at max_new_tokens)


class SettingsChanged(ValueError):
    """The evaluation folder holds samples drawn with other settings (or other prompts)."""


def prompt_sha256(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


class CompletionLog:
    """The finished samples of one evaluation folder; ``append`` is thread-safe (the server engine's workers call it)."""

    def __init__(self, out_dir: str | Path, settings: Mapping[str, Any]) -> None:
        self.out = Path(out_dir)
        self.path = self.out / COMPLETIONS_FILE
        self.settings = dict(settings)
        self.out.mkdir(parents=True, exist_ok=True)
        self._check_settings()
        self.done: dict[Key, Completion] = {}
        self.prompts: dict[str, str] = {}  # problem id -> sha256 of the prompt its samples answered
        self._read()
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")

    # ------------------------------------------------------------------------------------- reading

    def _check_settings(self) -> None:
        path = self.out / CONFIG_FILE
        if not path.is_file() or not (
            self.path.is_file() and self.path.stat().st_size
        ):  # no sample saved yet
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps({"settings": self.settings}, indent=2) + "\n", encoding="utf-8")
            os.replace(tmp, path)
            return
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))["settings"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not an infir2 evaluation config ({e}); use a new --out") from None
        changes = [
            f"{k}: {saved.get(k)!r} -> {self.settings.get(k)!r}"
            for k in sorted(saved.keys() | self.settings.keys())
            if saved.get(k) != self.settings.get(k)
        ]
        if changes:
            raise SettingsChanged(
                f"{self.out} holds samples drawn with other settings ({'; '.join(changes)}); rerun with the "
                f"saved settings to resume, or choose a new --out"
            )

    def _read(self) -> None:
        if not self.path.is_file():
            return
        raw = self.path.read_bytes()
        end = raw.rfind(b"\n") + 1
        if end < len(raw):  # a partial last line: the previous run was killed while writing it
            with self.path.open("r+b") as f:
                f.truncate(end)
        for lineno, line in enumerate(raw[:end].decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                key = (str(r["id"]), int(r["sample"]))
                completion = Completion(str(r["completion"]), int(r["n_tokens"]), bool(r["finished"]))
                sha = str(r["prompt_sha256"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{self.path}:{lineno}: not a completion record ({e})") from None
            if self.prompts.setdefault(key[0], sha) != sha:
                raise ValueError(f"{self.path}:{lineno}: problem {key[0]!r} has samples of two prompts")
            self.done.setdefault(key, completion)  # a duplicate (never written by infir2) keeps the first

    def check_prompts(self, prompts: Mapping[str, str]) -> None:
        """Refuse when a problem's prompt (``{id: prompt}``) is not the one its saved samples answered."""
        changed = [
            pid
            for pid, prompt in prompts.items()
            if pid in self.prompts and self.prompts[pid] != prompt_sha256(prompt)
        ]
        if changed:
            raise SettingsChanged(
                f"{self.path}: the prompts of problem(s) {changed[:3]} differ from those their saved samples "
                f"answered (changed data, system prompt or chat template); choose a new --out"
            )

    # ------------------------------------------------------------------------------------- writing

    def append(self, pid: str, sample: int, prompt: str, completion: Completion) -> None:
        """Record one finished sample (durably, before returning); a sample already recorded is ignored."""
        record: dict[str, Any] = {
            "id": pid,
            "sample": sample,
            "prompt_sha256": prompt_sha256(prompt),
            "completion": completion.text,
            "finished": completion.finished,
            "n_tokens": completion.n_tokens,
        }
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            if (pid, sample) in self.done:
                return
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())
            self.done[(pid, sample)] = completion
            self.prompts.setdefault(pid, record["prompt_sha256"])

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> CompletionLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
