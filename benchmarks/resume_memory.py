"""Peak memory of a resumed process vs the uninterrupted one (a full checkpoint, one process).

Two subprocesses on the same small Qwen2 shape (hidden 512, 2 layers, vocab 32,000, fp32, AdamW):
``save`` trains a step, writes a full checkpoint and trains two more; ``load`` builds the same model,
loads the checkpoint (``checkpoint.load_full``) and trains two steps. Each prints its RSS and peak RSS
above the RSS before the model was built, after each phase.

    PYTHONPATH=src python benchmarks/resume_memory.py --out /tmp/resume-memory
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
from pathlib import Path

MIB = 2**20
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # conftest's make_tiny_model


def _rss() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / MIB


def _peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB


def child(mode: str, out: Path) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from conftest import make_tiny_model
    from infir2.checkpoint import load_full, save_checkpoint
    from infir2.harness.optim import build_optimizer
    from infir2.model import prepare_for_training
    from infir2.train.config import OptimConfig

    torch.set_num_threads(1)
    start = _rss()
    model = prepare_for_training(
        make_tiny_model(vocab_size=32000, hidden=512, intermediate=1024, heads=8, max_positions=None), "bf16"
    )
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4))

    def step() -> None:
        ids = torch.randint(0, model.config.vocab_size, (1, 64))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def report(what: str) -> None:
        print(f"{mode:<5} {what:<24} rss {_rss() - start:7.0f} MiB   peak {_peak() - start:7.0f} MiB")

    if mode == "save":
        step()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd, osd = get_state_dict(model, optimizer, options=options)
        state = {"model": msd, "optimizer": osd, "scheduler": {}, "data": [None], "train_state": {}}
        save_checkpoint(out, 1, state)
        del msd, osd, state
        report("step 1 + save")
    else:
        load_full(out / "step_00000001", model, optimizer)
        report("loaded")
    step()
    step()
    report("two more steps")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="a scratch folder for the checkpoint (~450 MB)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    out = Path(args.out)
    if args.child:
        child(args.child, out)
        return
    shutil.rmtree(out, ignore_errors=True)
    for mode in ("save", "load"):
        run = subprocess.run(
            [sys.executable, __file__, "--out", str(out), "--child", mode],
            capture_output=True,
            text=True,
            check=True,
        )
        print("\n".join(line for line in run.stdout.splitlines() if line.startswith(mode)))


if __name__ == "__main__":
    main()
