"""Run under torchrun by test_moe_fsdp.py: a few FSDP2 steps of a tiny FP8 Qwen3-MoE (experts sharded on dim 0).

Writes the losses (a high-precision evaluation after the first step included: the all-gather
switches format twice), the final full weights and the all-gather bytes of rank 0 to
OUT_DIR/<mode>.pt per MODE (``fp32``, or ``fp32-fp8gather``: dense projections and experts
all-gathered as FP8 codes). In the FP8 mode it checks on every rank that each gathered expert
weight holds exactly the codes and scales one process quantizes.
Usage: torchrun --nproc_per_node 2 moe_fsdp_worker.py OUT_DIR MODE [MODE ...]
"""

from __future__ import annotations

import sys

import torch

from fsdp_param_gather_worker import run_modes
from infir2.fp8.quantize import quantize
from infir2.harness.distributed import DistEnv, shard_model
from infir2.harness.optim import build_optimizer
from infir2.model import prepare_for_training
from infir2.nn.fsdp import Fp8GatheredWeight
from infir2.nn.moe import Fp8Experts
from infir2.tools.wire_bytes import WireBytes
from infir2.train.config import OptimConfig
from infir2.train.loop import evaluate, train_step
from moe_models import make_tiny_moe
from train_synthetic import SyntheticSource

STEPS = 3
SOURCE = {"vocab_size": 256, "seed": 3, "global_batch_size": 4, "micro_batch_size": 1, "seq_len": 32}


def moe_model() -> torch.nn.Module:
    model = prepare_for_training(make_tiny_moe("qwen3_moe"), "blockwise")
    assert sum(isinstance(m, Fp8Experts) for m in model.modules()) == 2
    return model


def train_losses(model: torch.nn.Module, env, rank: int, world: int) -> list[float]:
    optimizer = build_optimizer(model, OptimConfig(lr=3e-3))
    source = SyntheticSource(rank=rank, world_size=world, **SOURCE)
    losses = []
    for step, batches in zip(range(STEPS), source, strict=False):
        losses.append(train_step(model, optimizer, batches, 3e-3, 1.0, "fp32", env)["loss"])
        if step == 0:  # FP8 off (high-precision gather) and on again
            val = SyntheticSource(rank=rank, world_size=world, **{**SOURCE, "seed": 9})
            losses.append(evaluate(model, iter(val), 1, "fp32", env))
    return losses


def check_gathered_experts(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> int:
    """All-gather each layer once more; every expert's gathered codes are those of one process."""
    checked = 0
    for layer in model.model.layers:
        layer.unshard()
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(experts, name)
            assert isinstance(w, Fp8GatheredWeight), type(w)
            master = full[f"{experts_fqn(model, experts)}.{name}"]
            for e, op in enumerate(w.operand.operands):
                data, scale_inv = quantize(master[e], op.block)
                assert torch.equal(op.data.view(torch.uint8), data.view(torch.uint8))
                assert torch.equal(op.scale_inv, scale_inv)
                checked += 1
        layer.reshard()
    return checked


def experts_fqn(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(fqn for fqn, m in model.named_modules() if m is module)


def run(mode: str, env: DistEnv) -> dict:
    model = moe_model()
    shard_model(model, "fp32", mode.endswith("fp8gather"))
    wire = WireBytes.install(model)
    losses = train_losses(model, env, env.rank, env.world_size)
    wire_bytes = wire.bytes
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if mode.endswith("fp8gather"):
        assert check_gathered_experts(model, full) == 2 * 2 * 4  # layers x weights x experts
    return {"losses": losses, "weights": full, "wire_bytes": wire_bytes}


def main(out_dir: str, modes: list[str]) -> None:
    run_modes(out_dir, modes, run)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
