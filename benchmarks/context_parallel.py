"""Context parallelism against one process: FP8 codes, loss and gradients measured, and the step time.

Runs ``tests/context_parallel_worker.py exact`` (one FP8 step of the tests' packed case: 2 rows of 1024
tokens, odd-length documents across shard edges, the tiny Qwen2 of hidden 128) on context 2 (2
processes), context 4 and data 2 x context 2 (4 processes), gloo on this CPU, and the same step in one
process; prints per layout whether every FP8 linear's input (and so its FP8 codes) is the one process's,
the loss's relative error, the worst gradient error (max |diff| / max |g| of a parameter) and where it
is, and the forward + backward seconds of the slowest rank. ``--recipe bf16`` runs the baseline (no FP8
cast in backward). GPU figures: not measured (no GPU lent yet). Prints the CPU (lscpu) first.

    python benchmarks/context_parallel.py [--recipe blockwise|bf16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from infir2.tools.machine import cpu_description  # noqa: E402 - after the path set-up, like the tests' helpers

LAYOUTS = ((2, ["2"], "d1c2", 1), (4, ["4", "2"], "d1c4", 1), (4, [], "d2c2", 2))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="blockwise", choices=("blockwise", "bf16"))
    args = p.parse_args()
    from context_parallel_case import compare, load_ranks, one_process
    from train_synthetic import torchrun

    print(f"CPU: {cpu_description()}; recipe {args.recipe}; GPU: not measured")
    worker = ROOT / "tests" / "context_parallel_worker.py"
    with tempfile.TemporaryDirectory() as tmp:
        for nproc, degrees, _, _ in LAYOUTS:
            if degrees:
                torchrun(worker, "exact", tmp, *degrees, "--recipe", args.recipe, nproc=nproc)
        ref = one_process(args.recipe)
        print(f"one process: forward + backward {ref['seconds']:.2f} s")
        suffix = "" if args.recipe == "blockwise" else f"-{args.recipe}"
        for _, _, folder, data in LAYOUTS:
            ranks = load_ranks(Path(tmp) / (folder + suffix))
            m = compare(ref, ranks, data)  # asserts the FP8 linears' inputs are bit-identical
            slowest = max(r["seconds"] for r in ranks)
            same = "FP8 linear inputs and codes identical" if ref["inputs"] else "no FP8 linear (bf16)"
            print(
                f"{folder}: {same}; loss rel err {m['loss']:.1e}; worst grad "
                f"{m['grad']:.1e} ({m['worst']}); last layer's MLP + lm_head {m['last_layer']:.1e}; "
                f"slowest rank forward + backward {slowest:.2f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
