"""Run under ``torchrun --nproc_per_node 1`` by ``test_gpu_kernels.py`` (with ``TORCH_CUDA_SANITIZER=1``):
FSDP2 over NCCL with the FP8 parameter all-gather and fused AdamW, on one GPU.

World size 1 still runs FSDP2's all-gather streams (copy-in, all-gather, compute), so the CUDA
sanitizer reports a tensor read on one stream while another may write or free it (the FP8
``scale_inv`` made on the copy-in stream and read in forward and backward, for one). Checked here:

* three training steps (forward, backward, clip, fused AdamW) finish with finite losses, and the
  sanitizer reports nothing (it raises in the step that races);
* fused AdamW updates the FP8-gathered weights' masters (``Fp8ShardedWeight``) like the AdamW rule
  computed in fp64 from the same gradients (first step: ``p - lr * g / (|g| + eps)``);
* after training every FP8 weight all-gathered as codes equals ``quantize(master, 128x128)``.

Usage: torchrun --standalone --nproc_per_node 1 tests/gpu/fsdp_sanitizer_worker.py OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from infir2.fp8.quantize import quantize
from infir2.harness.distributed import init_distributed, shard_model
from infir2.harness.optim import build_optimizer
from infir2.model import prepare_for_training
from infir2.nn import Fp8Linear
from infir2.nn.fsdp import Fp8GatheredWeight, Fp8ShardedWeight
from infir2.train.config import OptimConfig
from infir2.train.loop import train_step

LR, EPS = 1e-3, 1e-8


def tiny_qwen2() -> torch.nn.Module:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest
    from conftest import make_tiny_model

    return make_tiny_model(vocab_size=512, hidden=256, max_positions=256)


def fused_adamw_first_step(model: torch.nn.Module, env) -> float:
    """One forward/backward and a fused AdamW step; the largest error against the fp64 AdamW rule."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0, fused=True)
    ids = torch.randint(0, 512, (2, 128), device=env.device)
    model(input_ids=ids, labels=ids).loss.backward()
    fp8 = [p for p in model.parameters() if isinstance(p._local_tensor, Fp8ShardedWeight)]
    assert fp8, "no FP8 all-gather weights"
    before = [(p._local_tensor._tensor.double().clone(), p.grad._local_tensor.double().clone()) for p in fp8]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    worst = 0.0
    for p, (w, g) in zip(fp8, before, strict=True):
        local = p._local_tensor
        assert isinstance(local, Fp8ShardedWeight), type(local)  # the wrapper survives the fused step
        expected = w - LR * g / (g.abs() + EPS)
        worst = max(worst, float((local._tensor.double() - expected).abs().max()))
    return worst


def main(out: str) -> None:
    env = init_distributed("auto")  # a GPU with NCCL; also runs on CPU with gloo (no sanitizer there)
    try:
        model = prepare_for_training(tiny_qwen2().to(env.device), "blockwise")
        shard_model(model, "bf16", fp8_param_gather=True)
        adamw_error = fused_adamw_first_step(model, env)
        optimizer = build_optimizer(model, OptimConfig(lr=LR))
        assert optimizer.defaults.get("fused") or env.device.type != "cuda", "fused AdamW on CUDA expected"
        g = torch.Generator(device=env.device).manual_seed(1)
        losses = []
        for _ in range(3):
            ids = torch.randint(0, 512, (1, 128), device=env.device, generator=g)
            stats = train_step(model, optimizer, [{"input_ids": ids, "labels": ids}], LR, 1.0, "bf16", env)
            losses.append(float(stats["loss"]))
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        layers = list(model.model.layers)
        for layer in layers:
            layer.unshard()
        exact = 0
        for name, m in model.named_modules():
            if isinstance(m, Fp8Linear) and isinstance(m.weight, Fp8GatheredWeight):
                data, scale_inv = quantize(
                    full[f"{name}.weight"], m.recipe.w.block, m.recipe.w.fmt, m.recipe.w.scale_encoding
                )
                same = torch.equal(m.weight.operand.data.view(torch.uint8), data.view(torch.uint8))
                exact += int(same and torch.equal(m.weight.operand.scale_inv, scale_inv))
        for layer in layers:
            layer.reshard()
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        result = {
            "losses": losses,
            "adamw_max_error": adamw_error,
            "fp8_weights_exact": exact,
            "fp8_weights": 7 * len(layers),
        }
        with open(out, "w") as f:
            json.dump(result, f)
        print(json.dumps(result))
    finally:
        env.close()


if __name__ == "__main__":
    main(sys.argv[1])
