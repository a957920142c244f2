"""Process-group setup, FSDP2 sharding and the few collectives the loop needs.

One code path for every scale: a plain ``python`` run is world size 1 (no process group, no
sharding); under ``torchrun --nproc_per_node N`` each process joins the group (NCCL on GPUs, gloo
on CPUs) and the model is sharded with FSDP2: ``fully_shard`` on every decoder layer, then on the
root, after ``convert_to_fp8`` (``Fp8Linear`` holds ordinary parameters, so FSDP shards them like
any ``nn.Linear``). Gradients are reduce-scattered in fp32 (the masters' dtype). A caller that
already initialised a process group (a test, a notebook) keeps it; ``train`` only tears down
what it set up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistEnv",
    "all_reduce_sum",
    "broadcast_object",
    "gather_objects",
    "init_distributed",
    "shard_model",
]


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool  # True when init_distributed created the process group (and must destroy it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _pick_device(preference: str) -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        raise ValueError("run.device is cuda but no CUDA device is available")
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    return torch.device("cuda") if use_cuda else torch.device("cpu")


def init_distributed(device_preference: str = "auto") -> DistEnv:
    """Join the torchrun process group if launched by torchrun (or reuse an existing one)."""
    device = _pick_device(device_preference)
    owns = False
    if not dist.is_initialized() and dist.is_torchelastic_launched():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owns = True
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return DistEnv(rank, world, device, owns)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a HF causal LM (``model.model.layers``), the FSDP units."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers; cannot shard it per decoder layer")
    return list(layers)


def shard_model(model: nn.Module) -> nn.Module:
    """FSDP2: shard each decoder layer, then the root (embedding, final norm, lm_head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def all_reduce_sum(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a tensor over ranks (identity in a single process)."""
    if env.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def gather_objects(obj: object, env: DistEnv) -> list[object] | None:
    """Every rank's ``obj`` on rank 0 (list by rank); None on the other ranks."""
    if not env.distributed:
        return [obj]
    out: list[object] | None = [None] * env.world_size if env.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj: object, env: DistEnv) -> object:
    """Rank 0's ``obj`` on every rank."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
