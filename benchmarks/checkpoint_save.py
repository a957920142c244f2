"""Checkpoint save time and rank-0 memory: full state on rank 0 (``infir2.checkpoint``) vs sharded DCP.

    torchrun --standalone --nproc_per_node 2 benchmarks/checkpoint_save.py --out /tmp/ckpt-bench [--modes full]

Builds a ~100M-parameter Qwen2 (FSDP2, FP8 all-gather on), takes one training step so that AdamW has
its state, then saves it each way: ``full`` gathers model and optimizer on rank 0 (CPU) and writes
``state.pt``; ``dcp`` writes each rank's shards (``infir2.checkpoint.sharded``); ``dcp-async``
is the time until training could go on (the state is staged in memory, the write continues in a
thread), then the time until the folder is complete. Memory: rank 0's resident-set peak during the
save minus its size before (``/proc/self/clear_refs`` resets the peak; Linux only). Memory freed by an
earlier mode of the same launch may be reused by a later one: ``--modes`` with one mode per launch.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_tiny_model
from infir2 import checkpoint as ckpt
from infir2.harness.distributed import gather_objects, init_distributed, shard_model
from infir2.harness.optim import build_optimizer
from infir2.model import prepare_for_training
from infir2.train.config import OptimConfig
from infir2.train.loop import train_step


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def model_100m() -> torch.nn.Module:
    """A ~100M-parameter Qwen2 (the tests' builder; HF's default context length)."""
    return make_tiny_model(
        vocab_size=32000, hidden=768, layers=8, intermediate=2048, heads=12, kv_heads=4, max_positions=None
    )


def save_full(root: Path, model, optimizer, env) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    data = gather_objects({"step": 1}, env)
    if env.is_main:
        state = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": {"step": 1},
            "data": data,
            "train_state": {"world_size": env.world_size},
        }
        ckpt.save_checkpoint(root, 1, state)
    torch.distributed.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["full", "dcp", "dcp-async"],
        help="formats to save, in this order (one per launch gives the cleanest memory figure)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    out = Path(args.out)
    try:
        model = shard_model(prepare_for_training(model_100m(), "blockwise"), "fp32", True)
        n_params = sum(p.numel() for p in model.parameters())
        optimizer = build_optimizer(model, OptimConfig(lr=1e-4))
        ids = torch.randint(0, 32000, (1, 16))
        train_step(model, optimizer, [{"input_ids": ids, "labels": ids}], 1e-4, 1.0, "fp32", env)
        rows = []
        for mode in args.modes:
            root = out / mode
            if env.is_main:
                shutil.rmtree(root, ignore_errors=True)
            torch.distributed.barrier()
            gc.collect()
            Path("/proc/self/clear_refs").write_text("5")  # reset the resident-set peak (VmHWM)
            before, start = rss_kib("VmRSS"), time.perf_counter()
            returned = None
            if mode == "full":
                save_full(root, model, optimizer, env)
            else:
                pending = ckpt.save_sharded(
                    root, 1, model, optimizer, {"train_state": {}}, env, async_save=mode == "dcp-async"
                )
                returned = time.perf_counter() - start
                pending.wait()
            seconds = time.perf_counter() - start
            peak = rss_kib("VmHWM") - before
            size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if env.is_main else 0
            rows.append((mode, seconds, returned, peak / 2**20, size / 2**30))
        if env.is_main:
            print(
                f"checkpoint save, {n_params / 1e6:.0f}M parameters, {env.world_size} ranks (CPU, gloo), torch {torch.__version__}"
            )
            print(
                f"{'format':<10} {'save s':>8} {'training waits s':>17} {'rank-0 extra peak GiB':>22} {'on disk GiB':>12}"
            )
            for mode, seconds, returned, peak, size in rows:
                waits = seconds if returned is None or mode == "dcp" else returned
                print(f"{mode:<10} {seconds:>8.2f} {waits:>17.2f} {peak:>22.3f} {size:>12.3f}")
    finally:
        env.close()


if __name__ == "__main__":
    main()
