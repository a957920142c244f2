"""Process-group setup, FSDP2 sharding and the few collectives the loop needs.

One code path for every scale: a plain ``python`` run is world size 1 (no process group, no
sharding); under ``torchrun --nproc_per_node N`` each process joins the group (NCCL on GPUs, gloo
on CPUs) and the model is sharded with FSDP2: ``fully_shard`` on every decoder layer and on an untied
input embedding, then on the root, after ``convert_to_fp8`` (``Fp8Linear`` holds ordinary parameters, so FSDP shards them like
any ``nn.Linear``). A caller that already initialised a process group (a test, a notebook) keeps
it; ``train`` only tears down what it set up, and a caller ends its own group with
``destroy_process_group`` (here), which also drops the references FSDP2 left to it in DTensor's caches.

What travels per step (each layer is all-gathered before its forward and again before its backward):

* ``model.precision: fp32``: the fp32 masters, 4 bytes per parameter;
* ``model.precision: bf16``: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (the
  torchtitan default): 2 bytes per parameter; gradients are reduce-scattered in fp32 and the
  optimizer keeps fp32 masters;
* ``fp8.param_gather`` (default on for the blockwise recipes): the weights of the FP8 linears travel
  as their FP8 codes, 1 byte per element, quantized exactly as one process would
  (``infir2.nn.fsdp``); embeddings, norms, biases and ``lm_head`` follow the precision above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .. import _dist
from .._dist import (  # noqa: F401 - re-exported: the collectives the stages use
    DistEnv,
    all_gather_objects,
    all_reduce_max,
    all_reduce_sum,
    broadcast_object,
    destroy_process_group,
    gather_objects,
    release_mesh_caches,
)
from ..model import resolve_device

__all__ = [
    *_dist.__all__,
    "ContextLayout",
    "context_layout",
    "context_parallel",
    "data_ranks",
    "init_distributed",
    "shard_model",
    "untied_input_embedding",
]


@dataclass(frozen=True)
class ContextLayout:
    """The world as data x context: rank ``r`` is context rank ``r % context`` of data replica
    ``r // context`` (a sequence's ranks are neighbours: one node on GPUs). ``group``: this rank's context
    group (None when ``context`` is 1); ``data_env``: the ``DistEnv`` the data sources split over."""

    context: int
    context_rank: int
    group: dist.ProcessGroup | None
    data_env: DistEnv


def data_ranks(world_size: int, context: int) -> int:
    """The data degree of ``world_size`` processes at context degree ``context`` (which must divide it)."""
    if context < 1 or world_size % context:
        raise ValueError(
            f"parallel.context: {context} does not divide the {world_size} processes "
            "(the world is data x context)"
        )
    return world_size // context


def context_layout(env: DistEnv, context: int) -> ContextLayout:
    """This rank's place on the data x context grid; every rank must call it (it makes the groups)."""
    data_env = DistEnv(env.rank // context, data_ranks(env.world_size, context), env.device, False)
    group = None
    if context > 1:
        for replica in range(env.world_size // context):  # every rank makes every group, in one order
            ranks = list(range(replica * context, (replica + 1) * context))
            made = dist.new_group(ranks)
            if env.rank in ranks:
                group = made
    return ContextLayout(context, env.rank % context, group, data_env)


def context_parallel(model: nn.Module, layout: ContextLayout) -> nn.Module:
    """``model``'s attention over ``layout``'s context group (``nn.context_parallel``: it then runs only on
    sequence shards); at context 1 ``model`` unchanged. For a stage that may not import ``nn`` (rl)."""
    if layout.context == 1:
        return model
    from ..nn.context_parallel import enable_context_parallel

    return enable_context_parallel(model, layout.group)


def init_distributed(device_preference: str = "auto") -> DistEnv:
    """Join the torchrun process group if launched by torchrun (or reuse an existing one)."""
    device = resolve_device(device_preference, "run.device")
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


def shard_model(model: nn.Module, precision: str = "fp32", fp8_param_gather: bool = False) -> nn.Module:
    """FSDP2: shard each decoder layer, the input embedding (when ``lm_head`` does not share its weight),
    then the root (final norm, lm_head).

    The embedding is a unit of its own, as in torchtitan, so that it is resharded after its forward: the
    root stays gathered from its forward through backward (FSDP2 never reshards the root after forward),
    and an embedding inside it would hold ``vocab x hidden`` gathered weights over the whole backward
    (1.02 GiB in bf16 at Qwen2.5-7B) although only its own backward, the last, reads them. A tied
    embedding is ``lm_head``'s weight and stays in the root.

    ``precision`` ``bf16`` all-gathers parameters in bf16 and reduce-scatters gradients in fp32;
    ``fp8_param_gather`` all-gathers the FP8 linears' weights as FP8 codes (module docstring).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..nn.convert import enable_fp8_param_gather, link_fsdp_params

    if precision not in ("fp32", "bf16"):
        raise ValueError(f"model.precision must be fp32 or bf16, got {precision!r}")
    mp = MixedPrecisionPolicy()  # no casts: fp32 all-gather and reduce-scatter
    if precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        if fp8_param_gather:
            enable_fp8_param_gather(layer)
        fully_shard(layer, mp_policy=mp)
        if fp8_param_gather:
            link_fsdp_params(layer)
    embedding = untied_input_embedding(model)
    if embedding is not None:
        fully_shard(embedding, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def untied_input_embedding(model: nn.Module) -> nn.Module | None:
    """The input embedding module of a HF causal LM, or None when ``lm_head`` shares its weight (or the
    model has none to name)."""
    get_in, get_out = (
        getattr(model, "get_input_embeddings", None),
        getattr(model, "get_output_embeddings", None),
    )
    embedding = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if embedding is None or (head is not None and head.weight is embedding.weight):
        return None
    return embedding
