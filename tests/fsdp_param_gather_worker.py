"""Run under torchrun by test_fsdp_param_gather.py: a few FSDP2 steps with each all-gather mode.

Builds the same tiny Qwen2 (projection rows 128, 64 and 201: 128-row blocks straddle the two ranks,
and 201 rows shard unevenly, 101 + 100) for every mode, trains ``STEPS`` steps on the same global
batches, and writes per mode the losses, the final full weights and the all-gather bytes of rank 0 to
OUT_DIR/<mode>.pt.
After training it also all-gathers once more and checks, on every rank, that each FP8 weight that
arrived as FP8 codes is bit-identical to ``quantize(full master weight, 128x128)`` of one process.
Usage: torchrun --nproc_per_node 2 fsdp_param_gather_worker.py OUT_DIR MODE [MODE ...]
with MODE in fp32, fp32-fp8gather, bf16, bf16-fp8gather.
"""

from __future__ import annotations

import faulthandler
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from conftest import make_tiny_model
from infir2.fp8.quantize import quantize
from infir2.harness.distributed import DistEnv, init_distributed, shard_model
from infir2.harness.optim import build_optimizer
from infir2.model import prepare_for_training
from infir2.nn import Fp8Linear, convert_to_fp8
from infir2.nn.fsdp import Fp8GatheredWeight
from infir2.tools.wire_bytes import AmaxBytes, WireBytes
from infir2.train.config import OptimConfig
from infir2.train.loop import evaluate, train_step
from train_synthetic import SyntheticSource

STEPS = 3
SOURCE = {"seed": 3, "global_batch_size": 4, "micro_batch_size": 1, "seq_len": 16}


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    return make_tiny_model(seed=seed, intermediate=201, max_positions=64)


def train_and_eval(model: torch.nn.Module, precision: str, env, rank: int, world: int) -> list[float]:
    """``STEPS`` training steps with a high-precision evaluation (FP8 off) after the first; the losses."""
    optimizer = build_optimizer(model, OptimConfig(lr=3e-3))
    source = SyntheticSource(rank=rank, world_size=world, **SOURCE)
    losses = []
    for step, micro_batches in zip(range(STEPS), source, strict=False):
        losses.append(train_step(model, optimizer, micro_batches, 3e-3, 1.0, precision, env)["loss"])
        if step == 0:  # FP8 off and on again: the all-gather switches format twice
            val = SyntheticSource(rank=rank, world_size=world, **{**SOURCE, "seed": 9})
            losses.append(evaluate(model, iter(val), 1, precision, env))
    return losses


def fp8_model():
    """The tiny Qwen2 prepared for training with every decoder projection in FP8, the odd 201-row ones
    too (the default filter keeps dims that are not multiples of 16 high precision; CPU backends take any)."""
    model = prepare_for_training(tiny_qwen2(), "bf16")
    return convert_to_fp8(model, "blockwise", module_filter_fn=lambda m, fqn: ".layers." in fqn)


def run(mode: str, rank: int, world: int, env) -> dict:
    precision, fp8_gather = mode.split("-")[0], mode.endswith("fp8gather")
    model = fp8_model()
    shard_model(model, precision, fp8_gather)
    wire = WireBytes.install(model)
    losses = train_and_eval(model, precision, env, rank, world)
    wire_bytes = wire.bytes
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    layers = list(model.model.layers)
    amax = AmaxBytes.install()
    for layer in layers:  # all-gather every decoder layer once more, outside a forward
        layer.unshard()
    amax.remove()
    # one block-amax all-reduce per FSDP unit (decoder layer), not one per FP8 weight
    assert amax.collectives == (len(layers) if fp8_gather else 0), amax.collectives
    gathered = 0
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear) and isinstance(m.weight, Fp8GatheredWeight):
            data, scale_inv = quantize(
                full[f"{name}.weight"], m.recipe.w.block, m.recipe.w.fmt, m.recipe.w.scale_encoding
            )
            assert torch.equal(m.weight.operand.data.view(torch.uint8), data.view(torch.uint8)), name
            assert torch.equal(m.weight.operand.scale_inv, scale_inv), name
            gathered += 1
    for layer in layers:
        layer.reshard()
    assert gathered == (14 if fp8_gather else 0), gathered  # 7 projections x 2 layers
    return {"losses": losses, "weights": full, "wire_bytes": wire_bytes}


def run_modes(out_dir: str, modes: list[str], run_mode: Callable[[str, DistEnv], dict]) -> None:
    """Each mode's ``run_mode(mode, env)`` result saved by rank 0 as ``<out_dir>/<mode>.pt`` (one process
    group for all, a traceback after 240 s)."""
    faulthandler.dump_traceback_later(240, exit=True)
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    try:
        for mode in modes:
            result = run_mode(mode, env)
            if env.is_main:
                torch.save(result, f"{out_dir}/{mode}.pt")
        dist.barrier()
    finally:
        env.close()


def main(out_dir: str, modes: list[str]) -> None:
    run_modes(out_dir, modes, lambda mode, env: run(mode, env.rank, env.world_size, env))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
