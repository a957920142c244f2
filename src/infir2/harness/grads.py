"""Gradient storage (``optim.grad_dtype``): autograd's fp32 ``p.grad``, or bf16 kept beside the parameter.

With ``bf16``, a hook runs on each parameter as soon as autograd has accumulated its gradient
(``register_post_accumulate_grad_hook``): it moves the fp32 gradient into a bf16 tensor on the
parameter (``GRAD_ATTR``) and frees it, so one parameter's fp32 gradient is alive at a time instead of
all of them (2 bytes per parameter instead of 4, plus the largest parameter's fp32 gradient for a
moment). Micro-batches of one step accumulate in fp32 (``bf16(kept + g)``: one rounding per
micro-batch). The fp32 masters, the update math and the moments are untouched: ``grad_of(p)`` is what
the gradient norm, clipping and infir2's AdamWs read, and ``drop_grads`` clears both kinds.

One process only: under FSDP2 the reduce-scatter writes each rank's fp32 gradient shard itself (its
``reduce_dtype`` sets the wire, not the storage), so ``keep_bf16_grads`` refuses sharded parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["GRAD_ATTR", "GRAD_DTYPES", "check_grad_dtype", "drop_grads", "grad_of", "keep_bf16_grads"]

GRAD_DTYPES = ("fp32", "bf16")
#: the attribute of a parameter that holds its bf16 gradient
GRAD_ATTR = "infir2_grad"


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """``p``'s gradient: autograd's ``p.grad``, else the bf16 one the hook keeps, else None."""
    return p.grad if p.grad is not None else getattr(p, GRAD_ATTR, None)


def _keep(p: torch.Tensor) -> None:
    g = p.grad
    if g is None:
        return
    p.grad = None  # the fp32 gradient is freed here, one parameter at a time
    kept = getattr(p, GRAD_ATTR, None)
    if kept is None:
        setattr(p, GRAD_ATTR, g.to(torch.bfloat16))
    else:
        kept.copy_(kept.float().add_(g))


def check_grad_dtype(grad_dtype: str, world_size: int) -> None:
    """Before anything is built: bf16 gradients in a run of several processes are refused (module doc)."""
    if grad_dtype == "bf16" and world_size > 1:
        raise ValueError(
            f"optim.grad_dtype: bf16 gradients are kept in one process only, this run has {world_size} "
            "(under FSDP2 each rank's gradient shard is fp32): set optim.grad_dtype: fp32"
        )


def keep_bf16_grads(model: nn.Module) -> None:
    """Store ``model``'s gradients in bf16 from now on (module doc); once per model."""
    if getattr(model, "_infir2_bf16_grads", False):
        return
    params = [p for p in model.parameters() if p.requires_grad]
    if any(isinstance(p, DTensor) for p in params):
        raise ValueError(
            "optim.grad_dtype: bf16 gradients are kept in one process only; under FSDP2 each rank's "
            "gradient shard is fp32 (set optim.grad_dtype: fp32, or train in one process)"
        )
    for p in params:
        p.register_post_accumulate_grad_hook(_keep)
    model._infir2_bf16_grads = True  # type: ignore[assignment]


def drop_grads(params: Iterable[torch.Tensor]) -> None:
    """Free every gradient of ``params``: autograd's and the bf16 ones."""
    for p in params:
        p.grad = None
        if hasattr(p, GRAD_ATTR):
            delattr(p, GRAD_ATTR)
