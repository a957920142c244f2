"""Run under torchrun by test_rl_distributed.py: ``infir2 rl`` on two CPU processes (gloo, FSDP2).

First a check of the rollout weights under FSDP2: each rank's engine, loaded from the sharded policy,
holds the FP8 codes and scales that ``export.layout.quantize_weight`` makes of the whole master weights,
bit for bit (and every other weight equal). Then the command line, as a user runs it, with the test's
``parity`` reward registered. Usage:
torchrun --standalone --nproc_per_node 2 rl_distributed_worker.py [--no-engine-check] CONFIG.yaml [--set KEY=VALUE ...]
(``--no-engine-check``: the command line only, as ``tests/test_rl_context.py`` runs it).
"""

from __future__ import annotations

import copy
import faulthandler
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from conftest import make_tiny_model, make_tokenizer
from infir2.cli import main
from infir2.eval import Graded, register_grader
from infir2.export.layout import quantize_weight
from infir2.generation import BuiltinEngine
from infir2.harness.distributed import shard_model
from infir2.model import prepare_for_training
from train_synthetic import end_process_group


def parity(problem, text: str) -> Graded:
    """The test's grader (tests/test_rl_loop.py): correct for an odd number of characters."""
    return Graded(None, len(text) % 2 == 1)


def check_engine_weights() -> None:
    policy = prepare_for_training(make_tiny_model(seed=3), "blockwise")
    reference = copy.deepcopy(policy)
    engine = BuiltinEngine(
        policy,
        make_tokenizer(),
        precision="fp8",
        scale_encoding="pow2",
        model_precision="fp32",
        copy_model=True,
    )
    shard_model(policy, "fp32", fp8_param_gather=True)
    with torch.no_grad():  # new weights, the same on every rank, loaded into the shards
        gen = torch.Generator().manual_seed(5)
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    set_model_state_dict(policy, reference.state_dict(), options=StateDictOptions(full_state_dict=True))
    engine.load_weights(policy)
    fp8, rest = engine.quantized_weights(), engine.model.state_dict()
    assert len(fp8) == 2 * 7 * 2, sorted(fp8)
    for name, master in reference.named_parameters():
        if name in fp8:
            codes, scale_inv = quantize_weight(master.detach(), "pow2")
            assert torch.equal(fp8[name].view(torch.uint8), codes.view(torch.uint8)), name
            assert torch.equal(fp8[name + "_scale_inv"], scale_inv), name
        else:
            assert torch.equal(rest[name], master), name  # biases of FP8 layers included


if __name__ == "__main__":
    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows its stack instead of a silent timeout
    torch.set_num_threads(1)
    register_grader("parity", parity)
    dist.init_process_group("gloo")  # rl() keeps a group it finds (and leaves it to us)
    args = sys.argv[1:]
    if args[:1] == ["--no-engine-check"]:
        args = args[1:]
    else:
        check_engine_weights()
    code = main(["rl", *args, "--no-progress"])
    end_process_group(dist.get_rank())
    sys.exit(code)
