"""benchmarks/bad_input_probe.py's classifier on real runs of the command line: a refusal the probe counts
GOOD, and the outcomes it must count BAD (an exit 0 on a bad input, a traceback, a hang) or ACCEPTABLE
(a line that does not name the input, something written) -- so a probe total means what it says."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from train_synthetic import one_thread

_one_thread = pytest.fixture(autouse=True)(one_thread)

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bad_input_probe.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("bad_input_probe", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bad_input_probe"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bad_input_probe"]


@pytest.fixture(scope="module")
def world(probe):
    with probe.probe_world() as (w, cases):
        yield w, {c.name: c for c in cases}


def _verdict(probe, w, case) -> tuple[str, str]:
    return probe.classify(case, probe.run_case(case, w.root))


def test_the_probes_own_cases_good_and_acceptable(probe, world):
    w, cases = world
    assert len(cases) >= 140 and len(set(cases)) == len(cases)
    verdict, line = _verdict(probe, w, cases["train/lr-nan"])
    assert verdict == probe.GOOD and "optim.lr: must be a finite number" in line, line
    verdict, line = _verdict(probe, w, cases["rl/group-zero"])
    assert verdict == probe.GOOD, line
    # the same refusal, but the case expects another name in the line: not GOOD
    renamed = probe.Case("x", cases["train/lr-nan"].argv, ("optim.betas",))
    verdict, why = _verdict(probe, w, renamed)
    assert verdict == probe.ACCEPTABLE and "does not name optim.betas" in why


def test_an_rl_config_that_does_not_fit_is_warned_once_before_the_weights_load(probe, world):
    """rl/unfit: the planner's one warning line (the run, the peak, its phase, the limit), logged before
    transformers reads the weights; the run goes on. Without the warning, or after the weights, not GOOD."""
    import logging

    w, cases = world
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    probe.install_log_capture()  # log records to stderr, as the probe's own runs have them
    try:
        out = probe.run_case(cases["rl/unfit"], w.root)
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
    verdict, line = probe.classify(cases["rl/unfit"], out)
    assert verdict == probe.GOOD and out.rc == 0, line
    assert "planned peak" in line and "in the update" in line and "estimate" in line, line
    assert out.stderr.index(line) < out.stderr.index("Loading weights")
    silent = probe.Outcome(0, out.stderr.replace(line, ""))
    assert probe.classify(cases["rl/unfit"], silent)[0] == probe.ACCEPTABLE


def test_exit_0_a_traceback_a_hang_and_a_write_are_caught(probe, world, monkeypatch):
    w, _ = world
    verdict, why = _verdict(probe, w, probe.Case("exit0", ["config", "--list"], ("x",)))
    assert (verdict, why) == (probe.BAD, "exit 0 on a bad input")

    import infir2.tools.memory as memory

    def crashes(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(memory, "run", crashes)
    verdict, why = _verdict(probe, w, probe.Case("crash", ["memory"], ("x",)))
    assert verdict == probe.BAD and why == "traceback: RuntimeError: a bug"

    def hangs(args):
        import time

        time.sleep(30)

    monkeypatch.setattr(memory, "run", hangs)
    verdict, why = _verdict(probe, w, probe.Case("hang", ["memory"], ("x",), timeout=0.5))
    assert verdict == probe.BAD and why.startswith("hang")

    def writes_then_refuses(args):
        (w.root / "left-behind.txt").write_text("partial")
        raise ValueError("--tokens: bad")

    monkeypatch.setattr(memory, "run", writes_then_refuses)
    verdict, why = _verdict(probe, w, probe.Case("writes", ["memory"], ("--tokens",)))
    assert verdict == probe.ACCEPTABLE and "wrote left-behind.txt" in why


def test_message_lines_skip_logs_progress_and_usage_but_count_a_multiline_error(probe):
    stderr = (
        "usage: infir2 eval [-h]\n           [--x X]\n"
        "INFO infir2.x: loading\n  more of that record\n"
        "held-out loss: 0step [00:00, ?step/s]\n"
        "infir2 eval: error: f.yaml: not valid YAML\n  in line 2\n    ^\n"
    )
    assert probe.message_lines(stderr) == [
        "infir2 eval: error: f.yaml: not valid YAML",
        "  in line 2",
        "    ^",
    ]


_TORCHRUN_STDERR = """\
infir2 train: error: parallel.context: 3 does not divide the 2 processes (the world is data x context)
W1203 12:52:12.319000 7592 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 7604 closing signal SIGTERM
E1203 12:52:12.383000 7592 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 1
Traceback (most recent call last):
  File "/x/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
infir2.cli FAILED
------------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 7604)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 2 (pid: 7605)
============================================================"""


def test_torchruns_own_tail_is_set_apart_and_a_refusal_after_weights_is_not_good(probe):
    workers, tail = probe.split_launcher_tail(_TORCHRUN_STDERR)
    assert workers == _TORCHRUN_STDERR.splitlines()[0] and tail.endswith("=" * 60)
    assert probe._ROOT_EXIT.search(tail).group(1) == "2"  # the root cause's, not -15 (SIGTERM'd)
    # a worker's own traceback is kept, and counted BAD
    crashed = "Traceback (most recent call last):\n  File x\nKeyError: 'a'\n" + _TORCHRUN_STDERR
    workers, _ = probe.split_launcher_tail(crashed)
    case = probe.Case("t", ["train"], ("parallel.context",), torchrun=True)
    assert probe.classify(case, probe.Outcome(2, workers))[0] == probe.BAD
    line = _TORCHRUN_STDERR.splitlines()[0]
    assert probe.classify(case, probe.Outcome(2, line)) == (probe.GOOD, line)
    loaded = "Loading weights: 100%|##########| 15/15 [00:00<00:00, 9153.87it/s]\n" + line
    verdict, why = probe.classify(case, probe.Outcome(2, loaded))
    assert verdict == probe.ACCEPTABLE and why.startswith("refused after reading weights")
    counts = probe.outcome_counts(
        [{"why": why, "launcher_tail": 0}, {"why": "traceback: KeyError", "launcher_tail": 41}]
    )
    assert counts == {
        "tracebacks": 1,
        "hangs": 0,
        "exits 0": 0,
        "refused after reading weights": 1,
        "torchrun cases with torchrun's own tail": 1,
    }
