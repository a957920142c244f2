"""Golden losses: the first 20 steps of a tiny fixed-seed run per recipe, compared with the files in
``tests/golden/`` (relative tolerance 1e-5), so that a change to the numerics fails CI.

The run goes through the real training loop (``infir2.train``) with the synthetic source of the
training tests: a 2-layer Qwen2 of width 192 (1x128 tiles that are not whole rows), 64 tokens per
micro-batch (partial 128x1 tiles), 4 micro-batches per step, one intra-op thread. A deliberate change
of numerics regenerates the files, and the commit says why::

    python tests/test_golden_losses.py --write
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import make_tiny_model
from train_synthetic import SyntheticSource, tiny_run_config

GOLDEN = Path(__file__).parent / "golden"
RECIPES = ["bf16", "blockwise", "tensorwise", "mxfp8"]
STEPS = 20


def run_losses(recipe: str) -> list[float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as out:
            cfg = tiny_run_config(out, recipe, fp8={"recipe": recipe}, train={"max_steps": STEPS})
            model = make_tiny_model("qwen2", hidden=192, layers=2, seed=0)
            result = __import__("infir2.train", fromlist=["train"]).train(
                cfg, model=model, train_source=SyntheticSource(seed=3), progress=False
            )
    finally:
        torch.set_num_threads(threads)
    return [float(m["loss"]) for m in result.history]


@pytest.mark.parametrize("recipe", RECIPES)
def test_first_steps_match_the_golden_losses(recipe):
    expected = json.loads((GOLDEN / f"{recipe}.json").read_text())["losses"]
    got = run_losses(recipe)
    assert len(got) == len(expected) == STEPS
    for step, (g, e) in enumerate(zip(got, expected, strict=True), 1):
        assert abs(g - e) <= 1e-5 * abs(e), f"{recipe} step {step}: loss {g!r}, golden {e!r}"


if __name__ == "__main__":
    if sys.argv[1:2] != ["--write"]:
        sys.exit(
            "usage: python tests/test_golden_losses.py --write   (regenerates tests/golden/*.json; recipe names may follow)"
        )
    GOLDEN.mkdir(exist_ok=True)
    for name in sys.argv[2:] or RECIPES:
        losses = run_losses(name)
        (GOLDEN / f"{name}.json").write_text(
            json.dumps({"recipe": name, "steps": STEPS, "losses": losses}, indent=1) + "\n"
        )
        print(name, losses[0], losses[-1])
