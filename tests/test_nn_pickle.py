"""A converted model pickles: ``torch.save(model)`` / ``torch.load`` and multiprocessing spawn."""

from __future__ import annotations

import io
import multiprocessing as mp
import pickle

import pytest
import torch

from conftest import make_tiny_model
from infir2 import Fp8Linear, convert_to_fp8


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_torch_save_and_load_a_converted_model(recipe):
    model = convert_to_fp8(make_tiny_model(), recipe)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    layer = loaded.model.layers[0].self_attn.q_proj
    assert isinstance(layer, Fp8Linear) and layer.recipe.name == recipe
    assert [b.NAME for b in layer.kernels.chain] == [
        b.NAME for b in model.model.layers[0].self_attn.q_proj.kernels.chain
    ]
    ids = _ids()
    loss, grads = _loss_and_grads(model, ids)
    loss2, grads2 = _loss_and_grads(loaded, ids)
    assert torch.equal(loss, loss2)  # the same FP8 numerics, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2, strict=True))
    assert pickle.loads(pickle.dumps(model)).model.layers[1].mlp.down_proj.recipe.name == recipe


def _train_step_in_child(model: torch.nn.Module, ids: torch.Tensor, queue: mp.Queue) -> None:
    loss, grads = _loss_and_grads(model, ids)
    queue.put((loss.numpy(), [g.numpy() for g in grads]))  # numpy: sent by value, not shared memory


@pytest.mark.slow
def test_a_converted_model_goes_to_a_spawned_process():
    model = convert_to_fp8(make_tiny_model())
    ids = _ids()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_train_step_in_child, args=(model, ids, queue))
    child.start()
    try:
        loss_child, grads_child = queue.get(timeout=300)
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0
    loss, grads = _loss_and_grads(model, ids)
    assert torch.equal(loss, torch.from_numpy(loss_child))
    assert all(torch.equal(a, torch.from_numpy(b)) for a, b in zip(grads, grads_child, strict=True))
