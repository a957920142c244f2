"""A probe of bad inputs through the real command line (issues 28, 46 and 60): each case runs ``infir2 ...`` on a
bad input made from tiny fixtures in a temporary folder and is classified

  GOOD        exit 2 (or 1 for a server error), exactly one error line on stderr naming the input
              (the file, key or flag), nothing written (no new file or folder, no changed file);
  ACCEPTABLE  one error line that does not name the input, more than one error line, or something written;
  BAD         a traceback, a hang (the case's timeout), or exit 0 on a bad input (a silent wrong result).

A case marked ``warns`` is warned about, not refused (an RL config whose planned step does not fit the
machine: a plan is an estimate): GOOD is exactly one warning line naming the input, logged before any
weights load, and the run going on (``classify_warning``).

A refusal that comes after a model's weights were read (transformers' "Loading weights" bar) is
ACCEPTABLE, not GOOD: a bad input is refused before any weights load.

Most cases call ``infir2.cli.main`` in this process (stderr and the log captured, a SIGALRM timeout); the
few marked ``subprocess`` run ``python -m infir2.cli`` to see what a real process prints, and those
marked ``torchrun`` run it under ``torchrun --standalone`` on 2 CPU processes: the launcher's own tail
(its log lines and the ``ChildFailedError`` traceback and summary torchrun prints whenever a worker exits
non-zero) is set apart and its length shown at the end of the case's line, the workers' stderr is judged
as above, and the exit code is the root cause's (the first failed worker's), read from that summary. The
``nobody`` case runs as user nobody (``setpriv``) when the probe runs as root, whom chmod does not bind.
Prints a table (case, command, verdict, first error line), the totals and the counts of tracebacks,
hangs, exits 0 and refusals after reading weights; ``--only PATTERN`` runs the cases whose name holds
PATTERN (a regular expression): the fourth round's cases (issue 60) are named ``r4/...``, so
``--only '^r4/'`` runs them and ``--only '^(?!r4/)'`` the earlier rounds'.

    PYTHONPATH=src:tests OMP_NUM_THREADS=1 python benchmarks/bad_input_probe.py [--only eval] [--verbose]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

#: the cases that give a folder where a file belongs
FOLDER_CASES = {
    "train/sft-path-dir",
    "train/yaml-is-dir",
    "rl/prompts-dir",
    "eval/data-dir",
    "eval/model-file",
}
GOOD, ACCEPTABLE, BAD = "GOOD", "ACCEPTABLE", "BAD"
UNWRITABLE = "/sys/infir2-probe-out"  # root can write anywhere chmod allows; sysfs refuses a new folder
_ERROR_LINE = re.compile(r"error|Traceback|CRITICAL", re.IGNORECASE)


@dataclass
class Case:
    name: str
    argv: list[str]
    names: tuple[str, ...]  # texts of which one must be in the error line: the file / key / flag
    setup: Callable[[], None] | None = None
    server_error: bool = False  # exit 1 is as good as 2 (a server's failure, not the input's)
    subprocess: bool = False
    timeout: float = 90.0
    folder: bool = False  # the input is a folder where a file belongs: "not found" misleads
    torchrun: bool = False  # under torchrun on 2 CPU processes (the launcher's tail set apart)
    nobody: bool = (
        False  # a subprocess as user nobody when root (whom chmod does not bind): a read-only folder
    )
    warns: bool = False  # warned about, not refused: the run goes on (classify_warning)


@dataclass
class Outcome:
    rc: int | None  # None: timed out
    stderr: str
    written: list[str] = field(default_factory=list)
    seconds: float = 0.0
    launcher_tail: int = 0  # lines of torchrun's own tail, set apart from stderr


_LOG_RECORD = re.compile(r"^(?:[\d:]+ )?(DEBUG|INFO|WARNING) ")
_PROGRESS = re.compile(r"\d+%\||\[\d+:\d+[<,]")  # tqdm: "37%|###" or "[00:01<00:02" / "[00:00, ?step/s]"


def message_lines(stderr: str) -> list[str]:
    """What stderr says beyond log records below ERROR, progress bars, Python warnings and argparse's
    usage block: a clear refusal is exactly one such line. A multi-line message counts every line."""
    out, skipping = [], False
    for line in stderr.replace("\r", "\n").splitlines():
        if not line.strip() or _PROGRESS.search(line):
            continue
        if _LOG_RECORD.match(line) or line.startswith("usage:") or re.search(r"\w+Warning: ", line):
            skipping = True  # the record's (or usage's, or warning's) indented continuation lines follow
            continue
        if skipping and line.startswith(" "):
            continue
        skipping = False
        out.append(line)
    return out


def classify(case: Case, out: Outcome) -> tuple[str, str]:
    """(verdict, why): the rules of the module docstring."""
    if case.warns:
        return classify_warning(case, out)
    lines = message_lines(out.stderr)
    errors = [ln for ln in lines if _ERROR_LINE.search(ln)]
    first = (errors or lines or [""])[0]
    if out.rc is None:
        return BAD, f"hang: no exit within {case.timeout:.0f} s"
    if "Traceback" in out.stderr:
        last = [ln for ln in out.stderr.strip().splitlines() if ln and not ln.startswith(" ")][-1:]
        return BAD, f"traceback: {last[0] if last else '?'}"
    if out.rc == 0:
        return BAD, "exit 0 on a bad input"
    allowed = (1, 2) if case.server_error else (2,)
    problems = []
    if out.rc not in allowed:
        problems.append(f"exit {out.rc}")
    if len(lines) != 1:
        problems.append(f"{len(lines)} lines")
    if not any(n in first for n in case.names):
        problems.append("does not name " + " / ".join(case.names))
    if case.folder and re.search(r"not found|does not exist|no such", first, re.IGNORECASE):
        problems.append("a folder is said to be missing")
    if "Loading weights" in out.stderr:
        problems.append("refused after reading weights")
    if out.written:
        problems.append("wrote " + ", ".join(out.written[:3]))
    return (ACCEPTABLE, "; ".join(problems) + f": {first}") if problems else (GOOD, first)


_WARNING_RECORD = re.compile(r"^(?:[\d:]+ )?WARNING ")


def classify_warning(case: Case, out: Outcome) -> tuple[str, str]:
    """A case warned about, not refused (an RL config the planner says does not fit): GOOD when the run
    ends (exit 0, or 2 / 1 if it refuses later) with exactly one warning line naming the input, logged
    before any weights were read; the run's own folder is not counted as written."""
    if out.rc is None:
        return BAD, f"hang: no exit within {case.timeout:.0f} s"
    if "Traceback" in out.stderr:
        return BAD, "traceback"
    warned = [
        ln for ln in out.stderr.splitlines() if _WARNING_RECORD.match(ln) and any(n in ln for n in case.names)
    ]
    if len(warned) != 1:
        return ACCEPTABLE, f"{len(warned)} warning lines naming " + " / ".join(case.names)
    loaded = out.stderr.find("Loading weights")
    if loaded != -1 and loaded < out.stderr.find(warned[0]):
        return ACCEPTABLE, f"warned after reading weights: {warned[0]}"
    return GOOD, warned[0]


# ----------------------------------------------------------------------------- running one case


class _Timeout(BaseException):  # not an Exception: the CLI's handlers must not swallow it
    pass


class _Stderr(io.TextIOBase):
    """The log handler's stream: whatever ``sys.stderr`` is at the time of the write."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    seen = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            seen[os.path.relpath(p, root)] = (st.st_size if name in files else -1, st.st_mtime_ns)
    return seen


def _in_process(argv: list[str], timeout: float) -> tuple[int | None, str]:
    from infir2.cli import main

    def on_alarm(*_: object) -> None:
        raise _Timeout

    err = io.StringIO()
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    rc: int | None
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 2
            except _Timeout:
                rc = None
            except Exception:
                traceback.print_exc()
                rc = 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return rc, err.getvalue()


#: as root, run a command as ``nobody`` (util-linux's setpriv), whom a read-only folder binds
AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []


def _in_subprocess(
    argv: list[str], timeout: float, module: str = "infir2.cli", prefix: list[str] | None = None
) -> tuple[int | None, str]:
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(
            [*(prefix or []), sys.executable, "-m", module, *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None, ""
    return proc.returncode, proc.stderr


_LAUNCHER_LOG = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ \S*torch/distributed/elastic/")
_ROOT_EXIT = re.compile(r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d+)", re.DOTALL)


def split_launcher_tail(stderr: str) -> tuple[str, str]:
    """(the workers' stderr, torchrun's own tail): its elastic log lines, and from the traceback that
    ends in ``ChildFailedError`` to the end (the launcher's, printed after the workers have exited)."""
    lines = stderr.splitlines()
    start = len(lines)
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last):"):
            if any("ChildFailedError" in ln for ln in lines[i:]):
                start = i
            break
    workers = [ln for ln in lines[:start] if not _LAUNCHER_LOG.match(ln)]
    tail = [ln for ln in lines[:start] if _LAUNCHER_LOG.match(ln)] + lines[start:]
    return "\n".join(workers), "\n".join(tail)


def _in_torchrun(argv: list[str], timeout: float) -> tuple[int | None, str, int]:
    """``python -m infir2.cli ARGV`` under torchrun on 2 processes: (the root cause's exit code, the
    workers' stderr, lines of the launcher's tail)."""
    rc, stderr = _in_subprocess(
        ["--standalone", "--nproc_per_node", "2", "-m", "infir2.cli", *argv], timeout, "torch.distributed.run"
    )
    if rc is None:
        return None, stderr, 0
    workers, tail = split_launcher_tail(stderr)
    root = _ROOT_EXIT.search(tail)
    return (int(root.group(1)) if root else rc), workers, len(tail.splitlines())


def run_case(case: Case, root: Path) -> Outcome:
    if case.setup:
        case.setup()
    before = _snapshot(root)
    start = time.monotonic()
    tail = 0
    if case.torchrun:
        rc, stderr, tail = _in_torchrun(case.argv, case.timeout)
    elif case.nobody:
        rc, stderr = _in_subprocess(case.argv, case.timeout, prefix=AS_NOBODY)
    else:
        rc, stderr = (_in_subprocess if case.subprocess else _in_process)(case.argv, case.timeout)
    after = _snapshot(root)
    written = sorted(k for k, v in after.items() if (before.get(k) != v and v[0] != -1) or k not in before)
    return Outcome(rc, stderr, written, time.monotonic() - start, tail)


# ----------------------------------------------------------------------------- the fixtures


class World:
    """The good inputs every case damages one thing of, in ``root``."""

    def __init__(self, root: Path) -> None:
        import yaml

        from conftest import make_tiny_model, make_tokenizer
        from train_synthetic import prepared_cpt, tiny_llama

        self.root = root
        self.model = root / "model"  # vocabulary 300, 512 positions
        make_tiny_model(hidden=64, layers=1, seed=1).save_pretrained(self.model)
        make_tokenizer().save_pretrained(self.model)
        self.tok, self.cpt = prepared_cpt(root, documents=200)
        self.problems = self.write(
            "problems.jsonl", _jsonl({"problem": f"{i} + 1", "answer": str(i + 1)} for i in range(4))
        )
        self.chat = self.write(
            "chat.jsonl",
            _jsonl(
                {"messages": [{"role": "user", "content": f"{i}?"}, {"role": "assistant", "content": "ok"}]}
                for i in range(8)
            ),
        )
        self.file = self.write("a-file", "not a folder")
        self.train_cfg = {
            "run": {"name": "t", "out_dir": str(root / "runs"), "device": "cpu"},
            "model": {
                "from_config": tiny_llama(layers=1, max_positions=64),
                "tokenizer": str(self.tok),
                "precision": "fp32",
            },
            "fp8": {"recipe": "bf16"},
            "data": {"kind": "cpt", "train_path": str(self.cpt), "seq_len": 16, "global_batch_size": 2},
            "optim": {"lr": 1e-3},
            "schedule": {"name": "constant"},
            "train": {"max_steps": 1},
        }
        self.train_yaml = self.write("train.yaml", yaml.safe_dump(self.train_cfg))
        self.rl_cfg = {
            "run": {"name": "rl", "out_dir": str(root / "runs"), "device": "cpu"},
            "model": {"path": str(self.model), "precision": "fp32"},
            "data": {"prompts_path": str(self.problems)},
            "rollout": {"prompts_per_step": 2, "group_size": 2, "oversample_prompts": 2, "max_new_tokens": 4},
            "train": {"max_steps": 1},
        }
        self.rl_yaml = self.write("rl.yaml", yaml.safe_dump(self.rl_cfg))

    def write(self, name: str, text: str | bytes) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        return path

    def p(self, name: str) -> str:
        return str(self.root / name)

    def model_copy(self, name: str, damage: Callable[[Path], None]) -> Callable[[], None]:
        """A setup: ``root/name`` a copy of the model folder, then ``damage(folder)``."""

        def setup() -> None:
            shutil.copytree(self.model, self.root / name)
            damage(self.root / name)

        return setup

    def cpt_copy(self, name: str, damage: Callable[[Path], None]) -> Callable[[], None]:
        def setup() -> None:
            shutil.copytree(self.cpt, self.root / name)
            damage(self.root / name)

        return setup

    def yaml_file(self, name: str, text: str | bytes) -> Callable[[], None]:
        return lambda: self.write(name, text) and None


def _jsonl(records: Iterator[dict] | list) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _truncate(f: Path) -> None:
    data = (f / "model.safetensors").read_bytes()
    (f / "model.safetensors").write_bytes(data[: len(data) // 2])


def _garbage_header(f: Path) -> None:
    data = (f / "model.safetensors").read_bytes()
    (f / "model.safetensors").write_bytes(b"\xff" * 64 + data[64:])


def _broken_config(f: Path) -> None:
    (f / "config.json").write_text('{"model_type": "qwen2", ')


def _odd_bin(f: Path) -> None:
    with open(f / "train.bin", "ab") as fh:
        fh.write(b"\x01")  # half a uint16 token


def _no_weights(f: Path) -> None:
    (f / "model.safetensors").unlink()


def _config_is_a_list(f: Path) -> None:
    (f / "config.json").write_text("[1, 2]")


def _broken_tokenizer(f: Path) -> None:
    (f / "tokenizer.json").write_text("{not json")


def _garbage_checkpoint(w: World) -> Callable[[], None]:
    """A setup: ``root/ckpt-garbage``, a checkpoint folder whose state.pt holds no torch data."""

    def setup() -> None:
        (w.root / "ckpt-garbage").mkdir()
        (w.root / "ckpt-garbage" / "state.pt").write_bytes(b"\x00garbage" * 100)

    return setup


def _truncated_checkpoint(w: World) -> Callable[[], None]:
    """A setup: one real step of training saved, its checkpoint copied to ``root/ckpt-cut`` and the
    largest file there cut in half."""

    def setup() -> None:
        from infir2.cli import main

        argv = ["train", str(w.train_yaml), "--no-progress", "--set", "run.name=ckpt-source"]
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            assert main(argv) == 0
        source = sorted((w.root / "runs" / "ckpt-source" / "checkpoints").glob("step_*"))[-1]
        shutil.copytree(source, w.root / "ckpt-cut")
        biggest = max(
            (p for p in (w.root / "ckpt-cut").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
        )
        biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])

    return setup


def _big_tokenizer(f: Path) -> None:
    from conftest import make_tokenizer

    make_tokenizer(vocab_size=600).save_pretrained(f)


# ----------------------------------------------------------------------------- the cases


def _stage_case(command: str, config: Path, name: str, sets: list[str], names: tuple[str, ...], **kw) -> Case:
    """``infir2 COMMAND CONFIG --set run.name=NAME --set ...``: a run of its own for each case."""
    argv = [command, str(config), "--no-progress", "--set", f"run.name={name}"]
    return Case(f"{command}/{name}", argv + [x for s in sets for x in ("--set", s)], names, **kw)


def train_cases(w: World) -> list[Case]:
    def t(name: str, sets: list[str], names: tuple[str, ...], **kw) -> Case:
        return _stage_case("train", w.train_yaml, name, sets, names, **kw)

    sets = [
        ("lr-str", "optim.lr=abc", "optim.lr"),
        ("lr-neg", "optim.lr=-1", "optim.lr"),
        ("lr-zero", "optim.lr=0", "optim.lr"),
        ("lr-nan", "optim.lr=nan", "optim.lr"),
        ("lr-inf", "optim.lr=inf", "optim.lr"),
        ("lr-huge", "optim.lr=1e39", "optim.lr"),
        ("lr-list", "optim.lr=[1,2]", "optim.lr"),
        ("betas-scalar", "optim.betas=0.9", "optim.betas"),
        ("betas-one", "optim.betas=[0.9]", "optim.betas"),
        ("betas-above-1", "optim.betas=[1.5,0.9]", "optim.betas"),
        ("eps-neg", "optim.eps=-1", "optim.eps"),
        ("wd-neg", "optim.weight_decay=-0.1", "optim.weight_decay"),
        ("clip-neg", "optim.grad_clip=-1", "optim.grad_clip"),
        ("state-dtype", "optim.state_dtype=fp16", "optim.state_dtype"),
        ("fused-str", "optim.fused=maybe", "optim.fused"),
        ("optim-unknown", "optim.nope=1", "optim.nope"),
        ("seq-zero", "data.seq_len=0", "data.seq_len"),
        ("seq-neg", "data.seq_len=-5", "data.seq_len"),
        ("seq-str", "data.seq_len=abc", "data.seq_len"),
        ("seq-float", "data.seq_len=16.5", "data.seq_len"),
        ("seq-bool", "data.seq_len=true", "data.seq_len"),
        ("seq-past-context", "data.seq_len=4096", "data.seq_len"),
        ("gbs-zero", "data.global_batch_size=0", "data.global_batch_size"),
        ("gbs-indivisible", "data.global_batch_size=3 data.micro_batch_size=2", "data.global_batch_size"),
        ("mbs-zero", "data.micro_batch_size=0", "data.micro_batch_size"),
        ("kind", "data.kind=pretrain", "data.kind"),
        ("train-path-missing", f"data.train_path={w.p('no-data')}", "no-data"),
        ("train-path-file", f"data.train_path={w.file}", "a-file"),
        ("train-path-empty", "data.train_path=", "data.train_path"),
        ("epochs-zero", "data.epochs=0", "data.epochs"),
        ("shuffle-str", "data.shuffle=maybe", "data.shuffle"),
        ("val-path-missing", f"data.val_path={w.p('no-val')}", "no-val"),
        ("steps-zero", "train.max_steps=0", "train.max_steps"),
        ("steps-neg", "train.max_steps=-1", "train.max_steps"),
        ("steps-float", "train.max_steps=1.5", "train.max_steps"),
        ("save-every-neg", "train.save_every=-1", "train.save_every"),
        ("keep-last-zero", "train.keep_last=0", "train.keep_last"),
        ("log-every-zero", "train.log_every=0", "train.log_every"),
        ("eval-every-neg", "train.eval_every=-1", "train.eval_every"),
        ("chunk-str", "train.loss_chunk_tokens=banana", "train.loss_chunk_tokens"),
        ("ckpt-format", "train.checkpoint_format=zip", "train.checkpoint_format"),
        ("skipped-zero", "train.max_skipped_in_row=0", "train.max_skipped_in_row"),
        ("schedule-name", "schedule.name=linear", "schedule.name"),
        ("warmup-frac-big", "schedule.warmup_fraction=1.5", "schedule.warmup_fraction"),
        ("min-lr-ratio-neg", "schedule.min_lr_ratio=-0.1", "schedule.min_lr_ratio"),
        ("decay-style", "schedule.decay_style=step", "schedule.decay_style"),
        ("recipe", "fp8.recipe=fp4", "fp8.recipe"),
        ("backend", "fp8.backend=magic", "fp8.backend"),
        ("stats-neg", "fp8.stats_every=-1", "fp8.stats_every"),
        ("precision", "model.precision=fp8", "model.precision"),
        ("arch", "model.from_config.arch=gpt9", "arch"),
        ("hidden-neg", "model.from_config.hidden_size=-64", "hidden_size"),
        ("heads-indivisible", "model.from_config.num_attention_heads=3", "num_attention_heads"),
        ("tokenizer-missing", f"model.tokenizer={w.p('no-tok')}", "no-tok"),
        ("tokenizer-file", f"model.tokenizer={w.file}", "a-file"),
        ("device-tpu9", "run.device=tpu9", "run.device"),
        ("seed-str", "run.seed=abc", "run.seed"),
        ("out-dir-file", f"run.out_dir={w.file}", "run.out_dir"),
        ("out-dir-unwritable", f"run.out_dir={UNWRITABLE}", "run.out_dir"),
        ("section-unknown", "foo.bar=1", "foo"),
        ("load-missing", f"load.path={w.p('no-ckpt')}", "no-ckpt"),
        ("load-mode", "load.mode=restore", "load.mode"),
        ("set-no-equals", "optim.lr", "--set"),
        ("set-no-section", "lr=1", "lr"),
        ("section-scalar", "optim=5", "optim"),
        ("lr-bool", "optim.lr=true", "optim.lr"),
        ("betas-str", "optim.betas=abc", "optim.betas"),
        ("max-length-zero", "data.max_length=0", "data.max_length"),
        ("overlong", "data.overlong=cut", "data.overlong"),
        ("spike-window-zero", "train.loss_spike_window=0", "train.loss_spike_window"),
        ("async-save-str", "train.async_save=later", "train.async_save"),
        ("val-path-file", f"data.val_path={w.file}", "a-file"),
    ]
    cases = [t(n, s.split(" "), (k,)) for n, s, k in sets]
    cases += [
        t("warmup-both", ["schedule.warmup_steps=1", "schedule.warmup_fraction=0.1"], ("warmup",)),
        t("name-escape", ["run.name=../../escape"], ("run.name",)),
        t("name-empty", ["run.name="], ("run.name",)),
        t("device-cuda", ["run.device=cuda"], ("run.device",)),
        t(
            "tokenizer-big",
            ["model.from_config=null", f"model.path={w.model}", f"model.tokenizer={w.p('m-train-big')}"],
            ("m-train-big",),
            setup=w.model_copy("m-train-big", _big_tokenizer),
        ),
        t(
            "load-garbage",
            [f"load.path={w.p('ckpt-garbage')}"],
            ("ckpt-garbage",),
            setup=_garbage_checkpoint(w),
        ),
        t("load-a-file", [f"load.path={w.file}"], ("a-file",)),
        t("load-truncated", [f"load.path={w.p('ckpt-cut')}"], ("ckpt-cut",), setup=_truncated_checkpoint(w)),
    ]
    # model folders, damaged
    model_sets = [
        ("model-missing", None, "no-model"),
        ("model-broken-config", _broken_config, "config.json"),
        ("model-config-list", _config_is_a_list, "config.json"),
        ("model-no-weights", _no_weights, "weights"),
        ("model-truncated", _truncate, "model.safetensors"),
        ("model-broken-tokenizer", _broken_tokenizer, "tokenizer"),
    ]
    for name, damage, needle in model_sets:
        folder = f"m-train-{name}" if damage else "no-model"
        setup = w.model_copy(folder, damage) if damage else None
        sets2 = ["model.from_config=null", f"model.path={w.p(folder)}", "model.tokenizer=null"]
        cases.append(t(name, sets2, (needle,), setup=setup))

    # the data folder, damaged
    data_sets = [
        ("bin-odd-size", _odd_bin, "train.bin"),
        ("meta-broken", lambda f: (f / "meta.json").write_text("{oops"), "meta.json"),
        ("meta-missing", lambda f: (f / "meta.json").unlink(), "meta.json"),
        ("bin-missing", lambda f: (f / "train.bin").unlink(), "train.bin"),
        ("meta-list", lambda f: (f / "meta.json").write_text("[1]"), "meta.json"),
        ("meta-dtype", lambda f: _edit_json(f / "meta.json", dtype="float7"), "meta.json"),
        ("bin-empty", lambda f: (f / "train.bin").write_bytes(b""), "cpt-bin-empty"),
    ]
    for name, damage, needle in data_sets:
        folder = f"cpt-{name}"
        cases.append(t(name, [f"data.train_path={w.p(folder)}"], (needle,), setup=w.cpt_copy(folder, damage)))
    # SFT files
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    sft_sets = [
        ("sft-no-messages", _jsonl([{"text": "hi"}])),
        ("sft-messages-str", _jsonl([{"messages": "hi"}])),
        ("sft-bad-role", _jsonl([{"messages": [{"role": "wizard", "content": "hi"}]}])),
        ("sft-empty", ""),
        ("sft-latin1", b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'),
        ("sft-bad-json", '{"messages": [\n'),
        ("sft-line-list", _jsonl([msgs])),
        ("sft-content-int", _jsonl([{"messages": [{"role": "user", "content": 5}, msgs[1]]}])),
    ]
    sft_common = ["data.kind=sft", "data.max_tokens_per_micro_batch=64", "data.max_length=64"]
    for name, text in sft_sets:
        f = f"{name}.jsonl"
        cases.append(t(name, [*sft_common, f"data.train_path={w.p(f)}"], (f,), setup=w.yaml_file(f, text)))
    cases.append(t("sft-path-dir", [*sft_common, f"data.train_path={w.cpt}"], ("cpt",)))
    return cases


def _edit_json(path: Path, **changes: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def yaml_cases(w: World) -> list[Case]:
    files: list[tuple[str, str | bytes | None]] = [
        ("syntax", "run: {name: x\noptim: [1,\n"),
        ("tab-indent", "run:\n\tname: x\n"),
        ("empty", ""),
        ("list", "- 1\n- 2\n"),
        ("scalar", "42\n"),
        ("latin1", b"run:\n  name: caf\xe9\n"),
        ("section-scalar", "optim: 5\n"),
        ("duplicate-key", None),  # the command's good config with a second `run:` section
        ("unknown-section", "nonsense:\n  a: 1\n"),
        ("unknown-key", "optim:\n  learning_rate: 1.0e-3\n"),
    ]
    cases = []
    for cmd in ("train", "config", "rl"):
        good = (w.rl_yaml if cmd == "rl" else w.train_yaml).read_text()
        for name, text in files:
            text = good + "run:\n  name: dup\n" if text is None else text
            f = f"y-{cmd}-{name}.yaml"
            extra = ["--no-progress"] if cmd != "config" else []
            cases.append(Case(f"{cmd}/yaml-{name}", [cmd, w.p(f), *extra], (f,), setup=w.yaml_file(f, text)))
    cases += [
        Case("train/yaml-missing", ["train", w.p("nope.yaml"), "--no-progress"], ("nope.yaml",)),
        Case("train/yaml-is-dir", ["train", str(w.cpt), "--no-progress"], ("cpt",)),
        Case("config/missing", ["config", w.p("nope.yaml")], ("nope.yaml",)),
        Case("config/world-size-zero", ["config", str(w.train_yaml), "--world-size", "0"], ("--world-size",)),
        Case("config/world-size-neg", ["config", str(w.train_yaml), "--world-size", "-1"], ("--world-size",)),
        Case("config/set-str", ["config", str(w.train_yaml), "--set", "optim.lr=abc"], ("optim.lr",)),
        Case("config/unknown-name", ["config", "no-such-config"], ("no-such-config",)),
        Case(
            "train/yaml-syntax-subprocess",
            ["train", w.p("y-train-syntax.yaml"), "--no-progress"],
            ("y-train-syntax.yaml",),
            subprocess=True,
        ),
    ]
    return cases


def rl_cases(w: World) -> list[Case]:
    def r(name: str, sets: list[str], names: tuple[str, ...], **kw) -> Case:
        return _stage_case("rl", w.rl_yaml, name, sets, names, **kw)

    sets = [
        ("pps-zero", "rollout.prompts_per_step=0", "rollout.prompts_per_step"),
        ("group-zero", "rollout.group_size=0", "rollout.group_size"),
        ("group-one", "rollout.group_size=1", "rollout.group_size"),
        ("oversample-below", "rollout.oversample_prompts=1", "rollout.oversample_prompts"),
        ("max-new-huge", "rollout.max_new_tokens=1000000000000", "rollout.max_new_tokens"),
        ("max-new-zero", "rollout.max_new_tokens=0", "rollout.max_new_tokens"),
        ("temp-neg", "rollout.temperature=-1", "rollout.temperature"),
        ("temp-nan", "rollout.temperature=nan", "rollout.temperature"),
        ("precision", "rollout.precision=int4", "rollout.precision"),
        ("precision-old-word", "rollout.precision=bf16", "rollout.precision"),
        ("engine", "rollout.engine=vllm9", "rollout.engine"),
        ("batch-zero", "rollout.batch_size=0", "rollout.batch_size"),
        ("reward", "rollout.reward=nope", "rollout.reward"),
        ("max-rounds-zero", "rollout.max_rounds=0", "rollout.max_rounds"),
        ("clip-low-neg", "algo.clip_low=-0.1", "algo.clip_low"),
        ("clip-high-str", "algo.clip_high=abc", "algo.clip_high"),
        ("tis", "algo.tis=sometimes", "algo.tis"),
        ("tis-cap-zero", "algo.tis_cap=0", "algo.tis_cap"),
        ("kl-neg", "algo.kl_coef=-1", "algo.kl_coef"),
        ("overlong", "algo.overlong=cut", "algo.overlong"),
        ("mbs-zero", "algo.micro_batch_size=0", "algo.micro_batch_size"),
        ("updates-zero", "algo.updates_per_batch=0", "algo.updates_per_batch"),
        ("steps-zero", "train.max_steps=0", "train.max_steps"),
        ("prob-error-below-1", "train.max_prob_error=0.5", "train.max_prob_error"),
        ("task", "data.task=poetry", "data.task"),
        ("prompts-missing", f"data.prompts_path={w.p('no-prompts.jsonl')}", "no-prompts.jsonl"),
        ("prompts-dir", f"data.prompts_path={w.cpt}", "cpt"),
        ("val-missing", f"data.val_path={w.p('no-val.jsonl')}", "no-val.jsonl"),
        ("unknown-key", "rollout.foo=1", "rollout.foo"),
        ("device-tpu9", "run.device=tpu9", "run.device"),
        ("lr-neg", "optim.lr=-1", "optim.lr"),
        ("name-escape", "run.name=../../escape", "run.name"),
        ("out-dir-file", f"run.out_dir={w.file}", "run.out_dir"),
        ("model-missing", f"model.path={w.p('no-model')}", "no-model"),
        ("out-dir-unwritable", f"run.out_dir={UNWRITABLE}", "run.out_dir"),
        ("eval-problems-zero", "train.eval_problems=0", "train.eval_problems"),
        ("carry-over-str", "rollout.carry_over=maybe", "rollout.carry_over"),
        ("scale-encoding", "rollout.scale_encoding=fp16", "rollout.scale_encoding"),
        ("overlong-buffer-neg", "algo.overlong_buffer=-1", "algo.overlong_buffer"),
        ("adv-eps-neg", "algo.adv_eps=-1", "algo.adv_eps"),
    ]
    cases = [r(n, [s], (k,)) for n, s, k in sets]
    # a config whose planned step does not fit this machine (update micro-batches of 10^9 sequences):
    # warned about before the weights load, not refused (a plan is an estimate); the run goes on
    cases.append(r("unfit", ["algo.micro_batch_size=1000000000"], ("RL run 'unfit'",), warns=True))
    prompt_files: list[tuple[str, str | bytes]] = [
        ("bad-json", '{"problem": "1+1", "answer": "2"}\n{"problem": oops\n'),
        ("no-answer", _jsonl([{"problem": "1+1"}] * 4)),
        ("latin1", b'{"problem": "caf\xe9", "answer": "2"}\n'),
        ("empty", ""),
        ("line-list", _jsonl([[1, 2]])),
        ("answer-list", _jsonl([{"problem": "1+1", "answer": [2]}] * 4)),
        ("duplicate-id", _jsonl([{"problem": "1+1", "answer": "2", "id": "q"}] * 2)),
        ("blank-lines-only", "\n\n  \n"),
    ]
    for name, text in prompt_files:
        f = f"prompts-{name}.jsonl"
        cases.append(r(f"prompts-{name}", [f"data.prompts_path={w.p(f)}"], (f,), setup=w.yaml_file(f, text)))
    for name, damage, needle in [
        ("model-broken-config", _broken_config, "config.json"),
        ("model-truncated", _truncate, "model.safetensors"),
        ("model-no-weights", _no_weights, "weights"),
    ]:
        folder = f"m-rl-{name}"
        cases.append(r(name, [f"model.path={w.p(folder)}"], (needle,), setup=w.model_copy(folder, damage)))
    cases.append(
        r(
            "tokenizer-big",
            [f"model.tokenizer={w.p('m-rl-big')}"],
            ("m-rl-big",),
            setup=w.model_copy("m-rl-big", _big_tokenizer),
        )
    )
    return cases


def _loss_argv(argv: list[str]) -> list[str]:
    """An eval command line with --perplexity without the common prefix's benchmark flags (--data,
    --limit, --max-new-tokens before --perplexity: refused in that mode since issue 60); a case's own
    flags after it stay. Any other command line is returned as it is."""
    if "--perplexity" not in argv:
        return argv
    start = argv.index("--perplexity")
    out, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
        elif i < start and word in ("--data", "--limit", "--max-new-tokens"):
            skip = True
        else:
            out.append(word)
    return out


def eval_cases(w: World) -> list[Case]:
    def e(name: str, extra: list[str], names: tuple[str, ...], model: str | None = None, **kw) -> Case:
        out = w.p(f"eval-out/{name}")
        argv = ["eval", "--model", model or str(w.model), "--data", str(w.problems), "--limit", "1"]
        argv += ["--max-new-tokens", "4", "--device", "cpu", "--out", out, *extra]
        return Case(f"eval/{name}", _loss_argv(argv), names, **kw)

    long_problem = " ".join(["the quick brown fox"] * 600)  # > 512 positions
    cases = [
        e("model-missing", [], ("no-model",), model=w.p("no-model")),
        e("model-file", [], ("a-file",), model=str(w.file)),
        e("device-tpu9", ["--device", "tpu9"], ("--device",)),
        e("device-cuda", ["--device", "cuda"], ("--device",)),
        e("limit-neg", ["--limit", "-1"], ("--limit",)),
        e("limit-zero", ["--limit", "0"], ("--limit",)),
        e("limit-str", ["--limit", "x"], ("--limit",)),
        e("n-zero", ["--n", "0"], ("--n",)),
        e("n-neg", ["--n", "-3"], ("--n",)),
        e("greedy-n2", ["--greedy", "--n", "2"], ("--greedy", "--n")),
        e("temp-neg", ["--temperature", "-1"], ("--temperature",)),
        e("temp-nan", ["--temperature", "nan"], ("--temperature",)),
        e("top-p-zero", ["--top-p", "0"], ("--top-p",)),
        e("top-p-big", ["--top-p", "1.5"], ("--top-p",)),
        e("max-new-zero", ["--max-new-tokens", "0"], ("--max-new-tokens",)),
        e("max-new-huge", ["--max-new-tokens", str(10**12)], ("--max-new-tokens",)),
        e("batch-zero", ["--batch-size", "0"], ("--batch-size",)),
        e("seed-str", ["--seed", "abc"], ("--seed",)),
        e("recipe-unknown", ["--precision", "recipe", "--recipe", "fp4"], ("--recipe",)),
        e("recipe-missing", ["--precision", "recipe"], ("--recipe",)),
        e("task", ["--task", "poetry"], ("--task",)),
        e("tokenizer-missing", ["--tokenizer", w.p("no-tok")], ("no-tok",)),
        e("out-file", [], ("--out", "a-file"), model=None),
        e("data-missing", ["--data", w.p("no-data.jsonl")], ("no-data.jsonl",)),
        e("data-dir", ["--data", str(w.cpt)], ("cpt",)),
        e("out-unwritable", ["--out", UNWRITABLE], ("--out", UNWRITABLE)),
        e("perplexity-missing", ["--perplexity", w.p("no-tokens"), "--seq-len", "16"], ("no-tokens",)),
        e("perplexity-split", ["--perplexity", str(w.cpt), "--split", "nope", "--seq-len", "16"], ("nope",)),
        e("perplexity-seq-zero", ["--perplexity", str(w.cpt), "--seq-len", "0"], ("--seq-len",)),
        e("perplexity-seq-past", ["--perplexity", str(w.cpt), "--seq-len", "100000"], ("--seq-len",)),
        e(
            "perplexity-windows-zero",
            ["--perplexity", str(w.cpt), "--max-windows", "0", "--seq-len", "16"],
            ("--max-windows",),
        ),
        e(
            "perplexity-bin-odd",
            ["--perplexity", w.p("cpt-ppl-odd"), "--split", "train", "--seq-len", "16"],
            ("train.bin",),
            setup=w.cpt_copy("cpt-ppl-odd", _odd_bin),
        ),
        e(
            "tokenizer-big",
            ["--tokenizer", w.p("m-eval-big")],
            ("m-eval-big", "tokenizer"),
            setup=w.model_copy("m-eval-big", _big_tokenizer),
        ),
        e(
            "prompt-past-context",
            ["--data", w.p("long.jsonl")],
            ("long.jsonl", "context", "positions"),
            setup=w.yaml_file("long.jsonl", _jsonl([{"problem": long_problem, "answer": "1"}])),
        ),
        e(
            "device-cuda-subprocess",
            ["--device", "cuda"],
            ("--device",),
            subprocess=True,
        ),
    ]
    out_file = next(c for c in cases if c.name == "eval/out-file")  # by name: an index shifts with the list
    out_file.argv[out_file.argv.index("--out") + 1] = str(w.file / "x")
    data_files: list[tuple[str, str | bytes]] = [
        ("bad-json", '{"problem": "1", "answer": "1"}\n{oops\n'),
        ("latin1", b'{"problem": "caf\xe9", "answer": "1"}\n'),
        ("empty", ""),
        ("no-problem", _jsonl([{"question": "1+1", "answer": "2"}])),
        ("no-answer", _jsonl([{"problem": "1+1"}])),
        ("line-list", _jsonl([[1, 2]])),
        ("problem-int", _jsonl([{"problem": 5, "answer": "2"}])),
        (
            "duplicate-id",
            _jsonl([{"problem": "a", "answer": "1", "id": "q"}, {"problem": "b", "answer": "2", "id": "q"}]),
        ),
    ]
    for name, text in data_files:
        f = f"data-{name}.jsonl"
        cases.append(e(f"data-{name}", ["--data", w.p(f)], (f,), setup=w.yaml_file(f, text)))
    for name, damage, needle in [
        ("model-broken-config", _broken_config, "config.json"),
        ("model-config-list", _config_is_a_list, "config.json"),
        ("model-truncated", _truncate, "model.safetensors"),
        ("model-garbage", _garbage_header, "model.safetensors"),
        ("model-no-weights", _no_weights, "weights"),
        ("model-broken-tokenizer", _broken_tokenizer, "tokenizer"),
    ]:
        folder = f"m-eval-{name}"
        cases.append(e(name, [], (needle,), model=w.p(folder), setup=w.model_copy(folder, damage)))

    def deleted_settings() -> None:  # a greedy run saved, its eval_config.json deleted
        from infir2.cli import main

        out = w.p("eval-out/settings-deleted")
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            main(
                [
                    "eval",
                    "--model",
                    str(w.model),
                    "--data",
                    str(w.problems),
                    "--limit",
                    "1",
                    "--greedy",
                    "--max-new-tokens",
                    "4",
                    "--device",
                    "cpu",
                    "--out",
                    out,
                ]
            )
        os.remove(os.path.join(out, "eval_config.json"))

    case = e("settings-deleted", ["--temperature", "0.9"], ("completions", "settings", "temperature"))
    case.setup = deleted_settings
    cases.append(case)
    return cases


# ----------------------------------------------------------------------------- issue 46: engines, MoE, torchrun


def _readable_by_all(root: Path) -> None:
    """Let ``nobody`` read the fixtures (a temporary folder is the owner's alone)."""
    for dirpath, _, files in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o644)


def _unrecognised_moe(w: World, name: str) -> Callable[[], None]:
    """A setup: ``root/name``, a tiny Llama-4 text model (experts the FP8 conversion does not run)."""

    def setup() -> None:
        from conftest import make_tokenizer
        from moe_models import make_unrecognised_moe

        if not (w.root / name).exists():
            with contextlib.redirect_stderr(io.StringIO()):  # the save's progress bar
                make_unrecognised_moe(vocab_size=300).save_pretrained(w.root / name)
            make_tokenizer().save_pretrained(w.root / name)

    return setup


def round3_cases(w: World, stub: StubServer) -> list[Case]:
    """Issue 46: eval refusals before any weights (a read-only --out, a rerun of other settings), engine
    names and options that do not exist, FP8 asked of an engine that cannot run it, MoE experts the
    conversion does not run, and parallel.context under torchrun."""
    eval_argv = ["eval", "--model", str(w.model), "--data", str(w.problems), "--limit", "1"]
    eval_argv += ["--max-new-tokens", "4"]

    def e(name: str, extra: list[str], names: tuple[str, ...], **kw) -> Case:
        return Case(f"eval/{name}", [*eval_argv, "--out", w.p(f"eval-out/{name}"), *extra], names, **kw)

    def s(name: str, extra: list[str], names: tuple[str, ...], **kw) -> Case:
        argv = ["eval", "--engine", "server", "--base-url", stub.url, "--model", "fake"]
        argv += ["--tokenizer", str(w.tok), "--data", str(w.problems), "--max-new-tokens", "4"]
        return Case(f"server/{name}", [*argv, "--out", w.p(f"server-out/{name}"), *extra], names, **kw)

    def ro_setup() -> None:
        _readable_by_all(w.root)
        (w.root / "eval-ro").mkdir(mode=0o555)
        os.chmod(w.root / "eval-ro", 0o555)

    cases = [
        e("engine-vllm", ["--engine", "vllm"], ("--engine",)),  # without vLLM: "needs vLLM: pip install ..."
        e("engine-unknown", ["--engine", "vllm9"], ("--engine",)),
        e("vllm-flag-on-builtin", ["--max-model-len", "64"], ("--max-model-len",)),
        e("builtin-concurrency", ["--concurrency", "4"], ("--concurrency",)),
        e("builtin-base-url", ["--base-url", stub.url], ("--base-url",)),
        e("builtin-extra-body", ["--extra-body", "{}"], ("--extra-body",)),
        e("scale-encoding-alone", ["--scale-encoding", "fp32"], ("--scale-encoding",)),
        e(
            "settings-changed",
            ["--temperature", "0.9"],
            ("temperature",),
            setup=_greedy_run(w, "settings-changed"),
        ),
        s("precision-fp8", ["--precision", "fp8"], ("--precision",)),
        s("precision-recipe", ["--precision", "recipe", "--recipe", "blockwise"], ("--precision",)),
        s("batch-size", ["--batch-size", "4"], ("--batch-size",)),
        s("device", ["--device", "cpu"], ("--device",)),
        s("beyond-context", ["--beyond-context"], ("--beyond-context",)),
        _stage_case("rl", w.rl_yaml, "engine-server", ["rollout.engine=server"], ("rollout.engine",)),
        _stage_case("rl", w.rl_yaml, "engine-vllm", ["rollout.engine=vllm"], ("rollout.engine",)),
        _stage_case(
            "train",
            w.train_yaml,
            "moe-unrecognised",
            ["model.from_config=null", f"model.path={w.p('m-llama4')}", "fp8.recipe=blockwise"],
            ("fp8.recipe",),
            setup=_unrecognised_moe(w, "m-llama4"),
        ),
        _stage_case(
            "rl",
            w.rl_yaml,
            "moe-experts-unrecognised",
            [f"model.path={w.p('m-llama4')}", "fp8.recipe=blockwise"],
            ("fp8.recipe",),
            setup=_unrecognised_moe(w, "m-llama4"),
        ),
    ]
    if not AS_NOBODY or shutil.which("setpriv"):  # a folder read-only for the command (not for root)
        cases.append(
            e("out-read-only", ["--out", w.p("eval-ro")], ("--out", "eval-ro"), setup=ro_setup, nobody=True)
        )
    cp = ["model.from_config.max_position_embeddings=512", "data.seq_len=384"]
    for name, sets, names in [
        ("cp-context-3-of-2", ["parallel.context=3", *cp], ("parallel.context",)),
        ("cp-context-zero", ["parallel.context=0"], ("parallel.context",)),
        ("cp-seq-len", ["parallel.context=2"], ("data.seq_len",)),
        (
            "cp-context-4-of-2",
            ["parallel.context=4", "model.from_config.max_position_embeddings=512", "data.seq_len=512"],
            ("parallel.context",),
        ),
    ]:
        cases.append(_stage_case("train", w.train_yaml, name, sets, names, torchrun=True, timeout=180))
    return cases


def _greedy_run(w: World, name: str) -> Callable[[], None]:
    """A setup: a greedy evaluation saved in ``eval-out/NAME`` (the folder a rerun is refused in)."""

    def setup() -> None:
        from infir2.cli import main

        argv = ["eval", "--model", str(w.model), "--data", str(w.problems), "--limit", "1", "--greedy"]
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            assert main([*argv, "--max-new-tokens", "4", "--out", w.p(f"eval-out/{name}")]) == 0

    return setup


# ----------------------------------------------------------------------------- issue 60: the fourth round


def _tiny_moe(w: World, name: str) -> Callable[[], None]:
    """A setup: ``root/name``, a tiny Qwen3-MoE (routed experts the FP8 recipes run, NVFP4 does not)."""

    def setup() -> None:
        from transformers import AutoModelForCausalLM

        from conftest import make_tokenizer
        from moe_models import moe_config

        if not (w.root / name).exists():
            config = moe_config("qwen3_moe")
            config.vocab_size = 300  # the fixtures' tokenizer
            with contextlib.redirect_stderr(io.StringIO()):
                AutoModelForCausalLM.from_config(config).save_pretrained(w.root / name)
            make_tokenizer().save_pretrained(w.root / name)

    return setup


def _section_null(w: World, name: str, cfg: dict, section: str) -> Callable[[], None]:
    """A setup: ``root/name``, the config ``cfg`` with ``section: null`` (PyYAML: an empty section)."""
    import yaml

    return w.yaml_file(name, yaml.safe_dump({**cfg, section: None}))


def round4_cases(w: World) -> list[Case]:
    """Issue 60, as a new user types them: malformed --set values (1), output folders of demo / demo --rl /
    fidelity that cannot be written (2), a run list that names a run twice (3), 0 given for a flag (4),
    a section given as null (5), refusals that need no weights (6), lines that say what to do (7), flags
    that do not apply (8)."""
    R = "r4/"
    cases: list[Case] = []
    # 1. a --set value that is not YAML
    for cmd, cfg in (("train", w.train_yaml), ("rl", w.rl_yaml)):
        for name, item, key in [
            (
                "set-brace",
                "guard.max_kl={" if cmd == "rl" else "optim.lr={",
                "max_kl" if cmd == "rl" else "optim.lr",
            ),
            ("set-bracket", "optim.betas=[0.9,", "optim.betas"),
            ("set-quote", 'run.name="unclosed', "run.name"),
            ("set-at", "run.name=@home", "run.name"),
            ("set-colon", "run.name=a: b: c", "run.name"),
        ]:
            c = _stage_case(cmd, cfg, name, [item], (key,))
            c.name = R + c.name
            cases.append(c)
    cases.append(
        Case(R + "config/set-brace", ["config", str(w.train_yaml), "--set", "optim.lr={"], ("optim.lr",))
    )
    cases.append(
        Case(
            R + "config/set-alias", ["config", str(w.rl_yaml), "--set", "algo.kl_coef=*x"], ("algo.kl_coef",)
        )
    )
    # 2. output folders checked before any work
    ro = w.p("r4-ro")

    def ro_setup() -> None:
        _readable_by_all(w.root)
        Path(ro).mkdir(mode=0o555, exist_ok=True)
        os.chmod(ro, 0o555)

    for cmd, extra in (("demo", ["--quick"]), ("demo-rl", ["--quick", "--rl"]), ("fidelity", ["--quick"])):
        argv = ["fidelity" if cmd == "fidelity" else "demo", *extra]
        cases += [
            Case(f"{R}{cmd}/out-file", [*argv, "--out", str(w.file)], ("--out",), timeout=60),
            Case(f"{R}{cmd}/out-under-file", [*argv, "--out", str(w.file / "x")], ("--out",), timeout=60),
            Case(f"{R}{cmd}/out-unwritable", [*argv, "--out", UNWRITABLE], ("--out",), timeout=60),
        ]
        if not AS_NOBODY or shutil.which("setpriv"):
            cases += [
                Case(
                    f"{R}{cmd}/out-read-only",
                    [*argv, "--out", ro],
                    ("--out",),
                    setup=ro_setup,
                    nobody=True,
                    timeout=60,
                ),
                Case(
                    f"{R}{cmd}/out-new-in-read-only",
                    [*argv, "--out", ro + "/new"],
                    ("--out",),
                    setup=ro_setup,
                    nobody=True,
                    timeout=60,
                ),
            ]
    # 3. a list that names a run twice
    dup = [
        ("demo/recipes-dup", ["demo", "--quick", "--recipes", "bf16,blockwise,blockwise"], ("--recipes",)),
        ("demo/recipes-dup-spaces", ["demo", "--quick", "--recipes", "bf16, bf16"], ("--recipes",)),
        (
            "demo/recipes-dup-tail",
            ["demo", "--quick", "--recipes", "bf16,nvfp4+tail,nvfp4+tail"],
            ("--recipes",),
        ),
        (
            "fidelity/recipes-dup",
            ["fidelity", "--quick", "--recipes", "bf16,blockwise,blockwise"],
            ("--recipes",),
        ),
        ("fidelity/widths-dup", ["fidelity", "--quick", "--widths", "128,128"], ("--widths",)),
        ("fidelity/seeds-dup", ["fidelity", "--quick", "--seeds", "0,1,0"], ("--seeds",)),
        ("fidelity/widths-str", ["fidelity", "--quick", "--widths", "wide"], ("--widths",)),
        ("fidelity/seeds-neg", ["fidelity", "--quick", "--seeds", "-1"], ("--seeds",)),
        (
            "memory/recipes-dup",
            ["memory", "--models", "1.5B", "--recipes", "blockwise,blockwise"],
            ("--recipes",),
        ),
        ("memory/models-dup", ["memory", "--models", "1.5B,1.5B"], ("--models",)),
        (
            "bench/recipes-dup",
            ["bench", "--device", "cpu", "--recipes", "blockwise,blockwise"],
            ("--recipes",),
        ),
        (
            "bench/sections-dup",
            ["bench", "--device", "cpu", "--sections", "quantize,quantize"],
            ("--sections",),
        ),
        (
            "bench/backends-dup",
            ["bench", "--device", "cpu", "--backends", "emulated,emulated"],
            ("--backends",),
        ),
        (
            "demo-rl/seeds-dup",
            ["demo", "--quick", "--rl", "--seeds", "1,1", "--out", w.p("r4-d")],
            ("--seeds",),
        ),
    ]
    out = ["--out", w.p("r4-dup")]  # inside the probe's folder, should a tree start the runs
    cases += [
        Case(R + n, [*a, *out] if a[0] in ("demo", "fidelity") and "--out" not in a else a, k, timeout=60)
        for n, a, k in dup
    ]
    # 4. zero is a value given
    eval_argv = [
        "eval",
        "--model",
        str(w.model),
        "--data",
        str(w.problems),
        "--limit",
        "1",
        "--max-new-tokens",
        "4",
    ]
    for flag in (
        "--tensor-parallel-size",
        "--memory-fraction",
        "--cpu-kv-cache-gib",
        "--max-model-len",
        "--concurrency",
        "--retries",
        "--request-timeout",
        "--samples-per-request",
    ):
        name = flag.strip("-")
        out = w.p(f"eval-out/r4-{name}")
        cases.append(Case(f"{R}eval/zero-{name}", [*eval_argv, "--out", out, flag, "0"], (flag,)))
    cases += [
        Case(
            R + "fidelity/steps-zero",
            ["fidelity", "--quick", "--steps", "0", "--out", w.p("r4-f")],
            ("--steps",),
        ),
        Case(
            R + "fidelity/layers-zero",
            ["fidelity", "--quick", "--layers", "0", "--out", w.p("r4-f")],
            ("--layers",),
        ),
        Case(R + "bench/layers-zero", ["bench", "--device", "cpu", "--layers", "0"], ("--layers",)),
        Case(R + "bench/seq-zero", ["bench", "--device", "cpu", "--seq", "0"], ("--seq",)),
    ]
    # 5. a section given as null
    for cmd, cfg, section, key in [
        ("rl", w.rl_cfg, "guard", "guard"),
        ("rl", w.rl_cfg, "algo", "algo"),
        ("train", w.train_cfg, "optim", "optim"),
        ("train", w.train_cfg, "schedule", "schedule"),
    ]:
        f = f"r4-{cmd}-{section}-null.yaml"
        cases.append(
            Case(
                f"{R}{cmd}/yaml-{section}-null",
                [cmd, w.p(f), "--no-progress"],
                (key,),
                setup=_section_null(w, f, cfg, section),
            )
        )
    for cmd, cfg, item in (
        ("rl", w.rl_yaml, "guard=null"),
        ("train", w.train_yaml, "fp8=null"),
        ("rl", w.rl_yaml, "rollout="),
    ):
        c = _stage_case(cmd, cfg, "set-section-null-" + item.split("=")[0], [item], (item.split("=")[0],))
        c.name = R + c.name
        cases.append(c)

    # 6. refusals that need no weights
    def e(name: str, extra: list[str], names: tuple[str, ...], model: str | None = None, **kw) -> Case:
        argv = [*eval_argv, "--out", w.p(f"eval-out/r4-{name}"), *extra]
        if model:
            argv[argv.index("--model") + 1] = model
        return Case(f"{R}eval/{name}", _loss_argv(argv), names, **kw)

    ppl = ["--perplexity", str(w.cpt), "--seq-len", "16", "--max-windows", "1"]
    cases += [
        e("recipe-comma", ["--precision", "recipe", "--recipe", "blockwise,tensorwise"], ("--recipe",)),
        e("recipe-not-fp8", ["--precision", "recipe", "--recipe", "bf16"], ("--recipe",)),
        e("recipe-tail", ["--precision", "recipe", "--recipe", "nvfp4+tail"], ("--recipe",)),
        e("ppl-recipe-unknown", [*ppl, "--precision", "recipe", "--recipe", "fp4"], ("--recipe",)),
        e(
            "ppl-recipe-comma",
            [*ppl, "--precision", "recipe", "--recipe", "blockwise,tensorwise"],
            ("--recipe",),
        ),
        e("ppl-recipe-not-fp8", [*ppl, "--precision", "recipe", "--recipe", "bf16"], ("--recipe",)),
        e(
            "nvfp4-moe",
            ["--precision", "recipe", "--recipe", "nvfp4"],
            ("--recipe", "nvfp4"),
            model=w.p("m-r4-moe"),
            setup=_tiny_moe(w, "m-r4-moe"),
        ),
        e(
            "ppl-nvfp4-moe",
            [*ppl, "--precision", "recipe", "--recipe", "nvfp4"],
            ("--recipe", "nvfp4"),
            model=w.p("m-r4-moe"),
            setup=_tiny_moe(w, "m-r4-moe"),
        ),
        e(
            "rerun-other-recipe",
            ["--precision", "recipe", "--recipe", "tensorwise", "--greedy"],
            ("--recipe", "recipe"),
            setup=_recipe_run(w, "r4-rerun-other-recipe", "blockwise"),
        ),
        e(
            "rerun-recipe-was-high",
            ["--precision", "recipe", "--recipe", "blockwise", "--greedy"],
            ("--precision", "precision"),
            setup=_greedy_run(w, "r4-rerun-recipe-was-high"),
        ),
    ]
    cases += [
        Case(
            R + "rl/nvfp4-moe",
            [
                "rl",
                str(w.rl_yaml),
                "--no-progress",
                "--set",
                "run.name=r4-moe",
                "--set",
                f"model.path={w.p('m-r4-moe')}",
                "--set",
                "fp8.recipe=nvfp4",
            ],
            ("fp8.recipe",),
            setup=_tiny_moe(w, "m-r4-moe"),
        ),
        Case(
            R + "train/nvfp4-moe",
            [
                "train",
                str(w.train_yaml),
                "--no-progress",
                "--set",
                "run.name=r4-moe",
                "--set",
                "model.from_config=null",
                "--set",
                f"model.path={w.p('m-r4-moe')}",
                "--set",
                "fp8.recipe=nvfp4",
            ],
            ("fp8.recipe",),
            setup=_tiny_moe(w, "m-r4-moe"),
        ),
    ]
    for cmd, cfg, sets in (
        ("train", w.train_yaml, ["fp8.recipe=nvfp4", "fp8.backend=fast_emulated"]),
        ("train", w.train_yaml, ["fp8.recipe=tensorwise", "fp8.backend=triton"]),
        ("rl", w.rl_yaml, ["fp8.recipe=blockwise", "fp8.backend=triton"]),
        ("rl", w.rl_yaml, ["fp8.recipe=nvfp4", "fp8.backend=compiled"]),
    ):
        c = _stage_case(
            cmd, cfg, "backend-" + sets[1].split("=")[1] + "-" + sets[0].split("=")[1], sets, ("fp8.backend",)
        )
        c.name = R + c.name
        cases.append(c)
    # 7. lines that say what to do
    cases += [
        Case(
            R + "demo/tail-takes-all",
            ["demo", "--quick", "--recipes", "bf16,nvfp4+tail", "--out", w.p("r4-d")],
            ("--recipes",),
            timeout=60,
        ),
        Case(
            R + "fidelity/tail-takes-all",
            ["fidelity", "--quick", "--recipes", "bf16,nvfp4+tail", "--out", w.p("r4-f")],
            ("--recipes",),
            timeout=60,
        ),
        Case(
            R + "train/tail-takes-all",
            [
                "train",
                str(w.train_yaml),
                "--no-progress",
                "--set",
                "run.name=r4-tail",
                "--set",
                "fp8.recipe=nvfp4",
                "--set",
                "fp8.high_precision_tail=0.5",
            ],
            ("fp8.high_precision_tail",),
        ),
        Case(R + "train/fp8-flag", ["train", str(w.train_yaml), "--fp8", "blockwise"], ("fp8.recipe",)),
        Case(R + "rl/fp8-flag", ["rl", str(w.rl_yaml), "--fp8"], ("rollout.precision",)),
        Case(R + "eval/fp8-flag", [*eval_argv, "--out", w.p("eval-out/r4-fp8"), "--fp8"], ("--precision",)),
        Case(
            R + "rl/cpt-config",
            ["rl", str(w.train_yaml), "--no-progress"],
            ("run this config with `infir2 train`",),
        ),
        Case(
            R + "train/rl-config",
            ["train", str(w.rl_yaml), "--no-progress"],
            ("run this config with `infir2 rl`",),
        ),
        Case(R + "config/rl-config-as-cpt", ["config", str(w.rl_yaml), "--stage", "train"], ("--stage",)),
    ]
    # 8. flags that do not apply, and an export that would not load
    for name, changes, needle in [
        ("hidden", {"hidden_size": 128}, "lm_head.weight"),
        ("layers", {"num_hidden_layers": 2, "layer_types": None}, "model.layers.1"),
        ("vocab", {"vocab_size": 512}, "lm_head.weight"),
    ]:
        folder = f"m-r4-config-{name}"
        cases.append(
            Case(
                f"{R}export/config-disagrees-{name}",
                ["export", "--model", w.p(folder), "--out", w.p(f"export-out/r4-{name}")],
                (needle,),
                setup=w.model_copy(folder, lambda f, c=changes: _edit_config(f, c)),
            )
        )
    cases += [
        e("split-without-ppl", ["--split", "train"], ("--split",)),
        e("seq-len-without-ppl", ["--seq-len", "32"], ("--seq-len",)),
        e("max-windows-without-ppl", ["--max-windows", "3"], ("--max-windows",)),
        e("ppl-with-n", [*ppl, "--n", "4"], ("--n",)),
        e("ppl-with-greedy", [*ppl, "--greedy"], ("--greedy",)),
        Case(R + "config/world-size-rl", ["config", str(w.rl_yaml), "--world-size", "4"], ("--world-size",)),
        Case(R + "config/set-with-keys", ["config", "--keys", "--set", "optim.lr=1"], ("--set",)),
        Case(
            R + "demo/report-only-seeds",
            ["demo", "--report-only", "--seeds", "0,1", "--out", w.p("r4-d")],
            ("--seeds",),
        ),
        Case(
            R + "demo/data-only-recipes",
            ["demo", "--data-only", "--recipes", "bf16", "--out", w.p("r4-d")],
            ("--recipes",),
        ),
        Case(
            R + "export/scale-encoding-bf16",
            [
                "export",
                "--model",
                str(w.model),
                "--out",
                w.p("export-out/r4-se"),
                "--format",
                "bf16",
                "--scale-encoding",
                "fp32",
            ],
            ("--scale-encoding",),
        ),
        Case(
            R + "export/whole-blocks-bf16",
            [
                "export",
                "--model",
                str(w.model),
                "--out",
                w.p("export-out/r4-wb"),
                "--format",
                "bf16",
                "--whole-blocks-only",
            ],
            ("--whole-blocks-only",),
        ),
    ]
    return cases


def _edit_config(folder: Path, changes: dict) -> None:
    """``folder/config.json`` with ``changes`` (a key changed to None is removed)."""
    config = {**json.loads((folder / "config.json").read_text()), **changes}
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def _recipe_run(w: World, name: str, recipe: str) -> Callable[[], None]:
    """A setup: a greedy evaluation through ``--precision recipe --recipe RECIPE`` saved in eval-out/NAME."""

    def setup() -> None:
        from infir2.cli import main

        argv = ["eval", "--model", str(w.model), "--data", str(w.problems), "--limit", "1", "--greedy"]
        argv += ["--precision", "recipe", "--recipe", recipe, "--max-new-tokens", "4"]
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            assert main([*argv, "--out", w.p(f"eval-out/{name}")]) == 0

    return setup


# ----------------------------------------------------------------------------- a scripted server


class StubServer:
    """An OpenAI-style /v1 server on 127.0.0.1 whose behaviour a case sets (``mode``)."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.answered = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send(200, json.dumps({"data": [{"id": "fake"}]}).encode())

            def do_POST(self) -> None:
                n = json.loads(self.rfile.read(int(self.headers["Content-Length"]))).get("n", 1)
                stub.answered += 1
                mode = stub.mode
                if mode == "dies-after-1" and stub.answered > 1:
                    mode = "500"
                if mode == "500":
                    return self._send(500, b'{"error": {"message": "boom"}}')
                if mode == "garbage":
                    return self._send(200, b"<html>not json")
                if mode == "no-choices":
                    return self._send(200, b'{"usage": {}}')
                choice = {"index": 0, "text": "\\boxed{2}", "finish_reason": "stop"}
                self._send(200, json.dumps({"choices": [choice] * n}).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def set(self, mode: str) -> Callable[[], None]:
        def setup() -> None:
            self.mode, self.answered = mode, 0

        return setup


def server_cases(w: World, stub: StubServer, silent_url: str, dead_url: str) -> list[Case]:
    def s(
        name: str, extra: list[str], names: tuple[str, ...], url: str | None = None, mode: str = "ok", **kw
    ) -> Case:
        argv = ["eval", "--engine", "server", "--base-url", url or stub.url, "--model", "fake"]
        argv += ["--tokenizer", str(w.tok), "--data", str(w.problems), "--max-new-tokens", "4"]
        argv += ["--retries", "0", "--concurrency", "1", "--out", w.p(f"server-out/{name}"), *extra]
        return Case(f"server/{name}", argv, names, setup=stub.set(mode), **kw)

    return [
        s("dead-port", [], ("127.0.0.1", "--base-url"), url=dead_url, server_error=True),
        s("not-a-url", [], ("--base-url",), url="foo"),
        s("always-500", [], ("500",), mode="500", server_error=True),
        s("garbage", [], ("JSON", "json"), mode="garbage", server_error=True),
        s("no-choices", [], ("choices",), mode="no-choices", server_error=True),
        s("never-answers", [], ("127.0.0.1", "--base-url"), url=silent_url, server_error=True, timeout=60),
        s("dies-mid-run", [], ("saved",), mode="dies-after-1", server_error=True),
        s("concurrency-zero", ["--concurrency", "0"], ("--concurrency",)),
        s("timeout-neg", ["--request-timeout", "-1"], ("--request-timeout",)),
        s("retries-neg", ["--retries", "-1"], ("--retries",)),
        s("extra-body-bad", ["--extra-body", "not json"], ("--extra-body",)),
        s("extra-body-list", ["--extra-body", "[1, 2]"], ("--extra-body",)),
        s("samples-per-request-zero", ["--samples-per-request", "0"], ("--samples-per-request",)),
        s("model-unknown", ["--model", "other"], ("other",), server_error=True),
    ]


# ----------------------------------------------------------------------------- the other commands


def other_cases(w: World) -> list[Case]:
    def x(name: str, argv: list[str], names: tuple[str, ...], **kw) -> Case:
        return Case(name, argv, names, **kw)

    def export(name: str, model: str, out: str | None = None, *extra: str, **kw) -> Case:
        argv = ["export", "--model", model, "--out", out or w.p(f"export-out/{name}"), *extra]
        return Case(f"export/{name}", argv, kw.pop("names"), **kw)

    cases = [
        export("model-missing", w.p("no-model"), names=("no-model",)),
        export("out-file", str(w.model), str(w.file), names=("a-file", "--out")),
        export("out-under-file", str(w.model), str(w.file / "x"), names=("a-file", "--out")),
        export("out-unwritable", str(w.model), UNWRITABLE, names=("--out", UNWRITABLE)),
        export("out-not-empty", str(w.model), str(w.cpt), names=("cpt",)),
        export("shard-size-str", str(w.model), None, "--max-shard-size", "abc", names=("--max-shard-size",)),
        export("shard-size-zero", str(w.model), None, "--max-shard-size", "0", names=("--max-shard-size",)),
        export("format", str(w.model), None, "--format", "int4", names=("--format",)),
        export("model-is-tokens", str(w.cpt), names=("cpt",)),
    ]
    for name, damage, needle in [
        ("model-broken-config", _broken_config, "config.json"),
        ("model-truncated", _truncate, "model.safetensors"),
        ("model-no-weights", _no_weights, "weights"),
    ]:
        folder = f"m-export-{name}"
        cases.append(export(name, w.p(folder), names=(needle,), setup=w.model_copy(folder, damage)))

    def prep(name: str, inputs: list[str], names: tuple[str, ...], *extra: str, **kw) -> Case:
        argv = ["prepare-cpt", *inputs, "--tokenizer", str(w.tok), "--out", w.p(f"prep-out/{name}")]
        return Case(f"prepare-cpt/{name}", [*argv, "--no-progress", *extra], names, **kw)

    docs = str(w.root / "docs.jsonl")
    for name, text in [
        ("latin1", b'{"text": "ok"}\n{"text": "caf\xe9"}\n'),
        ("bad-json", '{"text": "ok"}\n{"text": oops\n'),
        ("empty", ""),
        ("line-list", _jsonl([[1]])),
        ("text-int", _jsonl([{"text": 5}])),
        ("no-text", _jsonl([{"body": "hi"}])),
    ]:
        f = f"prep-{name}.jsonl"
        cases.append(prep(name, [w.p(f)], (f,), setup=w.yaml_file(f, text)))
    cases += [
        prep("input-missing", [w.p("no-docs.jsonl")], ("no-docs.jsonl",)),
        prep(
            "input-dir-empty",
            [w.p("empty-dir")],
            ("empty-dir",),
            setup=lambda: (w.root / "empty-dir").mkdir(),
        ),
        prep("val-fraction-big", [docs], ("--val-fraction",), "--val-fraction", "1.5"),
        prep("val-fraction-neg", [docs], ("--val-fraction",), "--val-fraction", "-0.1"),
        prep("text-field-missing", [docs], ("--text-field", "body"), "--text-field", "body"),
        Case(
            "prepare-cpt/tokenizer-missing",
            ["prepare-cpt", docs, "--tokenizer", w.p("no-tok"), "--out", w.p("prep-out/t"), "--no-progress"],
            ("no-tok",),
        ),
        Case(
            "prepare-cpt/out-file",
            ["prepare-cpt", docs, "--tokenizer", str(w.tok), "--out", str(w.file), "--no-progress"],
            ("a-file", "--out"),
        ),
        Case(
            "prepare-cpt/latin1-subprocess",
            ["prepare-cpt", w.p("prep-latin1.jsonl"), "--tokenizer", str(w.tok), "--out", w.p("prep-out/s")],
            ("prep-latin1.jsonl",),
            setup=w.yaml_file("prep-latin1.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n'),
            subprocess=True,
        ),
    ]
    cases += [
        x("plan/model-unknown", ["plan", "no-such-model"], ("no-such-model",)),
        x("plan/gpus-zero", ["plan", "qwen2.5-1.5b", "--gpus", "0"], ("--gpus",)),
        x("plan/seq-zero", ["plan", "qwen2.5-1.5b", "--seq-len", "0"], ("--seq-len",)),
        x("plan/micro-zero", ["plan", "qwen2.5-1.5b", "--micro-batch", "0"], ("--micro-batch",)),
        x(
            "plan/global-indivisible",
            ["plan", "qwen2.5-1.5b", "--gpus", "2", "--global-batch", "3"],
            ("--global-batch",),
        ),
        x("plan/recipe", ["plan", "qwen2.5-1.5b", "--recipe", "fp4"], ("--recipe",)),
        x(
            "plan/chunk-str",
            ["plan", "qwen2.5-1.5b", "--loss-chunk-tokens", "banana"],
            ("--loss-chunk-tokens",),
        ),
        x("memory/model", ["memory", "--models", "9B"], ("--models", "9B")),
        x("memory/tokens-zero", ["memory", "--tokens", "0"], ("--tokens",)),
        x("memory/recipe", ["memory", "--models", "1.5B", "--recipes", "fp4"], ("--recipes", "fp4")),
        x("bench/device", ["bench", "--device", "tpu9", "--preset", "quick"], ("--device",), timeout=60),
        x(
            "bench/backend",
            ["bench", "--backends", "magic", "--preset", "quick", "--device", "cpu"],
            ("--backends", "magic"),
            timeout=60,
        ),
        x(
            "bench/recipe",
            ["bench", "--recipes", "fp4", "--preset", "quick", "--device", "cpu"],
            ("--recipes", "fp4"),
            timeout=60,
        ),
        x(
            "bench/section",
            ["bench", "--sections", "nope", "--preset", "quick", "--device", "cpu"],
            ("--sections", "nope"),
            timeout=60,
        ),
        x(
            "bench/iters-zero",
            ["bench", "--iters", "0", "--preset", "quick", "--device", "cpu", "--sections", "quantize"],
            ("--iters",),
            timeout=60,
        ),
        x(
            "bench/tokens-neg",
            ["bench", "--tokens", "-1", "--preset", "quick", "--device", "cpu", "--sections", "linear"],
            ("--tokens",),
            timeout=60,
        ),
        x(
            "demo/recipe",
            ["demo", "--recipes", "fp4", "--out", w.p("demo-out/r"), "--report-only"],
            ("--recipes", "fp4"),
        ),
        x(
            "demo/seeds",
            ["demo", "--seeds", "abc", "--out", w.p("demo-out/s"), "--report-only"],
            ("--seeds",),
        ),
        x(
            "demo/jobs-zero",
            ["demo", "--jobs", "0", "--out", w.p("demo-out/j"), "--report-only"],
            ("--jobs",),
        ),
        x(
            "demo/report-missing",
            ["demo", "--report-only", "--out", w.p("demo-out/none")],
            ("demo-out/none",),
        ),
        x("demo/out-file", ["demo", "--report-only", "--out", str(w.file)], ("a-file", "--out")),
        x("numerics/missing-run", ["numerics", w.p("no-run")], ("no-run",)),
        x("numerics/not-a-run", ["numerics", str(w.cpt)], ("cpt",)),
        x("numerics/a-file", ["numerics", str(w.file)], ("a-file",)),
        x("numerics/top-zero", ["numerics", str(w.cpt), "--top", "0"], ("--top", "cpt")),
    ]
    return cases


# ----------------------------------------------------------------------------- main


@contextlib.contextmanager
def probe_world() -> Iterator[tuple[World, list[Case]]]:
    """The fixtures, the stub servers and every case; torn down on exit."""
    from infir2.generation import server as server_module

    with tempfile.TemporaryDirectory(prefix="infir2-probe-") as tmp:
        w = World(Path(tmp))
        stub = StubServer()
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts and never answers
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
        startup = server_module.STARTUP_TIMEOUT_S
        server_module.STARTUP_TIMEOUT_S = 3.0  # the silent server's case waits 3 s, not 30
        try:
            cases = train_cases(w) + yaml_cases(w) + rl_cases(w) + eval_cases(w)
            cases += server_cases(
                w,
                stub,
                f"http://127.0.0.1:{silent.getsockname()[1]}",
                f"http://127.0.0.1:{dead.getsockname()[1]}",
            )
            cases += other_cases(w) + round3_cases(w, stub) + round4_cases(w)
            for case in cases:
                case.folder = case.name in FOLDER_CASES
            yield w, cases
        finally:
            server_module.STARTUP_TIMEOUT_S = startup
            stub.httpd.shutdown()
            silent.close()
            dead.close()


def install_log_capture() -> None:
    """The root logger writes to whatever ``sys.stderr`` is (the CLI's own set-up then does nothing)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(_Stderr())
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def outcome_counts(results: list[dict]) -> dict[str, int]:
    """The issue's counts over the results: tracebacks, hangs, exits 0 on a bad input, refusals after a
    model's weights were read, and the torchrun cases with the launcher's own tail (not ours)."""
    whys = [r["why"] for r in results]
    return {
        "tracebacks": sum(w.startswith("traceback") for w in whys),
        "hangs": sum(w.startswith("hang") for w in whys),
        "exits 0": sum(w.startswith("exit 0") for w in whys),
        "refused after reading weights": sum("refused after reading weights" in w for w in whys),
        "torchrun cases with torchrun's own tail": sum(r["launcher_tail"] > 0 for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", help="run the cases whose name matches this regular expression")
    parser.add_argument("--verbose", action="store_true", help="print each case's whole stderr")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    install_log_capture()
    totals = {GOOD: 0, ACCEPTABLE: 0, BAD: 0}
    results = []
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        with contextlib.redirect_stderr(io.StringIO()):  # the fixtures' own log lines and progress bars
            w, cases = stack.enter_context(probe_world())
        chosen = [c for c in cases if not args.only or re.search(args.only, c.name)]
        for case in chosen:
            out = run_case(case, w.root)
            verdict, why = classify(case, out)
            totals[verdict] += 1
            cmd = " ".join(case.argv).replace(str(w.root) + "/", "")
            results.append(
                {
                    "case": case.name,
                    "verdict": verdict,
                    "why": why,
                    "rc": out.rc,
                    "command": cmd,
                    "launcher_tail": out.launcher_tail,
                }
            )
            tail = f" +{out.launcher_tail} torchrun lines" if case.torchrun else ""
            print(
                f"{case.name:38s} {verdict:10s} rc={out.rc} {out.seconds:5.1f}s  {why[:200]}{tail}",
                flush=True,
            )
            print(f"    $ infir2 {cmd[:300]}")
            if args.verbose:
                print("    " + out.stderr.strip().replace("\n", "\n    "))
    counts = outcome_counts(results)
    print(
        f"\n{len(results)} cases in {time.monotonic() - start:.0f} s: "
        f"good {totals[GOOD]}, acceptable {totals[ACCEPTABLE]}, bad {totals[BAD]}\n"
        + ", ".join(f"{k} {v}" for k, v in counts.items())
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"totals": totals, "counts": counts, "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
