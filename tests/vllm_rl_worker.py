"""Run by test_vllm_engine.py in the vLLM environment: ``infir2 rl CONFIG`` as a user runs it, with the
test's ``parity`` reward registered. ``--no-refit``: the control run, whose engine keeps the weights it
started with (every refit after the first is skipped), to show the drift a refit removes.

python tests/vllm_rl_worker.py CONFIG.yaml [--no-refit]
"""

from __future__ import annotations

import sys

from infir2.cli import main
from infir2.eval import Graded, register_grader


def parity(problem, text: str) -> Graded:
    """Correct for an odd number of characters: rewards that differ within a group, whatever the model."""
    return Graded(None, len(text) % 2 == 1)


def skip_refits_after_the_first() -> None:
    from infir2.generation.vllm_engine import VllmEngine

    first = VllmEngine.load_weights

    def once(self, policy) -> None:
        if not getattr(self, "_loaded_once", False):
            first(self, policy)
            self._loaded_once = True

    VllmEngine.load_weights = once  # type: ignore[method-assign]


if __name__ == "__main__":
    register_grader("parity", parity)
    if "--no-refit" in sys.argv:
        sys.argv.remove("--no-refit")
        skip_refits_after_the_first()
    sys.exit(main(["rl", sys.argv[1], "--no-progress"]))
