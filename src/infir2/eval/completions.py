"""The completions file of an evaluation folder: every finished sample, appended as it arrives, so nothing is lost.

``<out>/completions.jsonl`` holds one line per finished sample::

    {"id": "aime24-3", "sample": 17, "prompt_sha256": "9c1e...", "settings": "4be0...", "completion": "...",
     "finished": true, "n_tokens": 8123}

and ``<out>/eval_config.json`` the settings the samples were drawn with (``settings``: model, engine,
task, prompt, decoding). Each record carries the digest of those settings too (``settings``), so the
completions file alone decides: with ``eval_config.json`` deleted, a rerun with other settings is still
refused, and a rerun with the same settings writes it again and says so (one warning line). A rerun of
the same command reads both back and generates only the samples that are missing. A rerun with other
settings is refused, naming each changed key
(``temperature: 0.65 -> 0.7``), and so is a problem whose rendered prompt differs from the one its
saved samples answered (changed data, system prompt or chat template): mixing them would score a
different evaluation. Raising ``n`` (or dropping ``--limit``) is fine: the saved samples are kept and
the new ones are asked for.

Each line is written with one ``write`` and flushed (``fsync`` too) before the next sample is taken,
so a killed process leaves at worst one partial last line, which the next run cuts off. ``read_saved``
and ``check_prompts`` are the same checks without a write: ``infir2 eval`` makes them before it reads
any weights, so a refused rerun loads no model and leaves the folder as it was.
"""

from __future__ import annotations

import hashlib
import json
import logging
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
    "Saved",
    "SettingsChanged",
    "check_prompts",
    "make_out_dir",
    "prompt_sha256",
    "read_saved",
    "settings_digest",
]

COMPLETIONS_FILE = "completions.jsonl"
CONFIG_FILE = "eval_config.json"

Key = tuple[str, int]  # (problem id, sample index)

log = logging.getLogger(__name__)


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


def settings_digest(settings: Mapping[str, Any]) -> str:
    """The digest every record carries of the settings it was drawn with (canonical JSON, SHA-256)."""
    canonical = json.dumps(dict(settings), sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


@dataclass
class Saved:
    """What an evaluation folder holds, read without writing: the finished samples, the prompt digest of
    each problem's samples, ``rebuilt`` (``eval_config.json`` is missing and every record's settings
    digest matches the settings asked for) and ``end`` (where a partial last line starts, else None)."""

    done: dict[Key, Completion]
    prompts: dict[str, str]
    rebuilt: bool = False
    end: int | None = None


def read_saved(out: Path, settings: Mapping[str, Any]) -> Saved:
    """The samples saved in ``out``, checked against ``settings``; writes nothing (``infir2 eval`` calls it
    before any weights are read, ``CompletionLog`` again when it opens the folder).

    ``SettingsChanged`` when ``eval_config.json`` holds other settings (each changed key named) or, with
    it missing, when a record's settings digest differs or is absent; ``ValueError`` naming the file and
    line of a record that does not read.
    """
    path, config = out / COMPLETIONS_FILE, out / CONFIG_FILE
    saved = Saved({}, {})
    if not (path.is_file() and path.stat().st_size > 0):
        return saved
    if config.is_file():
        _check_config(config, settings)
    raw = path.read_bytes()
    end = raw.rfind(b"\n") + 1
    saved.end = end if end < len(raw) else None
    digest = settings_digest(settings)
    for lineno, line in enumerate(raw[:end].decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            key = (str(r["id"]), int(r["sample"]))
            completion = Completion(str(r["completion"]), int(r["n_tokens"]), bool(r["finished"]))
            sha = str(r["prompt_sha256"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{lineno}: not a completion record ({e})") from None
        _check_record_settings(path, lineno, r.get("settings"), digest, config.is_file())
        if saved.prompts.setdefault(key[0], sha) != sha:
            raise ValueError(f"{path}:{lineno}: problem {key[0]!r} has samples of two prompts")
        saved.done.setdefault(key, completion)  # a duplicate (never written by infir2) keeps the first
    saved.rebuilt = bool(saved.done) and not config.is_file()
    return saved


def _check_config(path: Path, settings: Mapping[str, Any]) -> None:
    """Refuse an ``eval_config.json`` of other settings than ``settings``, naming each changed key."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))["settings"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not an infir2 evaluation config ({e}); use a new --out") from None
    changes = [
        f"{k}: {saved.get(k)!r} -> {settings.get(k)!r}"
        for k in sorted(saved.keys() | settings.keys())
        if saved.get(k) != settings.get(k)
    ]
    if changes:
        raise SettingsChanged(
            f"{path.parent} holds samples drawn with other settings ({'; '.join(changes)}); rerun with the "
            f"saved settings to resume, or choose a new --out"
        )


def _check_record_settings(path: Path, lineno: int, digest: str | None, expected: str, config: bool) -> None:
    """A record drawn with other settings (its digest differs) is refused; one written before records
    carried a digest is accepted only beside a matching ``eval_config.json`` (``config``)."""
    if digest == expected or (digest is None and config):
        return
    why = "other settings" if digest else "settings it does not record, and eval_config.json is missing"
    raise SettingsChanged(
        f"{path}:{lineno}: this sample was drawn with {why}; rerun with the settings it was drawn "
        "with to resume, or choose a new --out"
    )


def check_prompts(path: Path, saved: Mapping[str, str], prompts: Mapping[str, str]) -> None:
    """Refuse when a problem's prompt (``{id: prompt}``) is not the one its samples saved in ``path``
    answered (``saved``: ``{id: prompt_sha256}``, as ``Saved.prompts``)."""
    changed = [pid for pid, prompt in prompts.items() if pid in saved and saved[pid] != prompt_sha256(prompt)]
    if changed:
        raise SettingsChanged(
            f"{path}: the prompts of problem(s) {changed[:3]} differ from those their saved samples "
            f"answered (changed data, system prompt or chat template); choose a new --out"
        )


def make_out_dir(out: Path) -> None:
    """``out`` and the folders above it made, or a ``ValueError`` naming --out (a file on the way, a
    folder that cannot be made)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"--out {out}: it (or a folder above it) is a file, not a folder") from None
    except OSError as e:
        raise ValueError(f"--out {out}: cannot create it: {e.strerror}") from None


class CompletionLog:
    """The finished samples of one evaluation folder; ``append`` is thread-safe (the server engine's workers call it)."""

    def __init__(self, out_dir: str | Path, settings: Mapping[str, Any]) -> None:
        self.out = Path(out_dir)
        self.path = self.out / COMPLETIONS_FILE
        self.settings = dict(settings)
        self.digest = settings_digest(self.settings)
        make_out_dir(self.out)
        saved = read_saved(self.out, self.settings)
        self.done, self.prompts = saved.done, saved.prompts
        try:
            if saved.end is not None:  # a partial last line: the previous run was killed while writing it
                with self.path.open("r+b") as f:
                    f.truncate(saved.end)
            if saved.rebuilt:
                log.warning(
                    "%s was missing: written again with these settings, the ones the %d samples saved in %s "
                    "were drawn with (each record's settings digest matches)",
                    self.out / CONFIG_FILE,
                    len(self.done),
                    self.path,
                )
            if saved.rebuilt or not self.done:  # the saved samples carry these settings, or none is saved
                self._write_settings()
            self._file = self.path.open("a", encoding="utf-8")
        except OSError as e:  # a read-only folder, said before any sample is drawn
            raise ValueError(
                f"--out {self.out}: cannot write {e.filename or self.out}: {e.strerror}"
            ) from None
        self._lock = threading.Lock()

    def _write_settings(self) -> None:
        path = self.out / CONFIG_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"settings": self.settings}, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    def check_prompts(self, prompts: Mapping[str, str]) -> None:
        """Refuse when a problem's prompt (``{id: prompt}``) is not the one its saved samples answered."""
        check_prompts(self.path, self.prompts, prompts)

    # ------------------------------------------------------------------------------------- writing

    def append(self, pid: str, sample: int, prompt: str, completion: Completion) -> None:
        """Record one finished sample (durably, before returning); a sample already recorded is ignored."""
        record: dict[str, Any] = {
            "id": pid,
            "sample": sample,
            "prompt_sha256": prompt_sha256(prompt),
            "settings": self.digest,
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
