"""The demo's worker processes end with the demo process (they used to go on writing into its folder)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

# A parent that starts a spawn pool as the demo does and gives it a task that would run for a minute,
# then, once the worker has started on its tasks (its first one made a folder), prints the worker's pid
# and waits to be killed. (A fixed delay instead of the folder was too short on loaded cores: a worker
# still starting up also ends with its parent, and the control below failed.)
PARENT = """
import multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from infir2.tools.demo.workers import die_with_parent

if __name__ == "__main__":
    initializer = die_with_parent if sys.argv[1] == "on" else None
    initargs = (os.getpid(),) if initializer else ()
    pool = ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn"), initializer=initializer, initargs=initargs
    )
    pool.submit(os.mkdir, sys.argv[2]).result()
    pool.submit(time.sleep, 60)
    print(multiprocessing.active_children()[0].pid, flush=True)
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _worker_after_parent_killed(mode: str, wait_s: float, marker: str) -> bool:
    """Start the parent, SIGKILL it once its worker runs, and tell whether the worker is alive ``wait_s`` later."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode, marker], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(0.5)  # the worker has taken its second task and sleeps in it
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.05)
        alive = _alive(child)
        if alive:
            os.kill(child, signal.SIGKILL)
        return alive
    finally:
        parent.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_ends_when_the_demo_process_is_killed(tmp_path):
    assert not _worker_after_parent_killed("on", wait_s=10, marker=str(tmp_path / "on"))
    # the control: without the initializer the same worker outlives its killed parent
    assert _worker_after_parent_killed("off", wait_s=2, marker=str(tmp_path / "off"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("parent", ["alive", "gone"])
def test_die_with_parent_ends_a_worker_only_when_its_parent_is_gone(parent):
    """A parent that is alive leaves the worker running; one that died before the request (the worker
    already has another parent) ends it at once."""
    pid = "os.getppid()" if parent == "alive" else "os.getppid() + 10**6"
    code = f"import os; from infir2.tools.demo.workers import die_with_parent; die_with_parent({pid}); print('ran')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if parent == "alive":
        assert (done.returncode, done.stdout.strip()) == (0, "ran")
    else:
        assert (done.returncode, done.stdout) == (-signal.SIGTERM, "")
