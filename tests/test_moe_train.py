"""A converted MoE model in the training loop: the loss falls, a crashed run resumes bit for bit, and
``torch.compile`` traces it without graph breaks."""

from __future__ import annotations

import pytest
import torch

from infir2 import convert_to_fp8
from infir2.nn import Fp8Linear
from infir2.nn.moe import Fp8Experts
from infir2.train import train
from moe_models import make_tiny_moe
from test_nn_compile import plain_compile_is_exact
from train_synthetic import CrashAfter, SyntheticSource, one_thread, tiny_run_config

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

_one_thread = pytest.fixture(autouse=True)(one_thread)
_DATA = {"vocab_size": 256, "seq_len": 32, "seed": 1}


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_converted_moe_trains_and_resumes_exactly(tmp_path, family):
    kw = {"train": {"max_steps": 8, "save_every": 4, "keep_last": 2}, "optim": {"lr": 3e-3}}
    full = train(
        tiny_run_config(tmp_path, "full", **kw),
        model=make_tiny_moe(family),
        train_source=SyntheticSource(**_DATA),
        progress=False,
    )
    losses = [m["loss"] for m in full.history]
    assert sum(losses[-2:]) / 2 < losses[0] - 0.3, losses  # it learns
    cfg = tiny_run_config(tmp_path, "split", **kw)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, model=make_tiny_moe(family), train_source=CrashAfter(4, **_DATA), progress=False)
    resumed = train(
        cfg, model=make_tiny_moe(family, seed=5), train_source=SyntheticSource(**_DATA), progress=False
    )
    assert [m["loss"] for m in resumed.history] == losses[4:]  # bit-identical after the crash


def _step(model, ids):
    from infir2.nn import cache_fp8_weights

    model.zero_grad()
    with cache_fp8_weights(model), torch.autocast("cpu", torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [loss.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]


@pytest.mark.slow
def test_compiled_fp8_moe_has_no_graph_break_and_eager_numerics():
    """fullgraph=True: a graph break is an error; each grouped linear is one custom op per direction."""
    import copy

    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return torch._functorch.aot_autograd.make_boxed_func(gm.forward)

    model = make_tiny_moe("qwen3_moe")
    convert_to_fp8(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(
        copy.deepcopy(model), backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True
    )
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    (eager_loss, *eager_grads), (loss, *grads) = _step(model, ids), _step(compiled, ids)
    assert torch.equal(eager_loss, loss)
    assert not counters["graph_break"]
    ops = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum(o.startswith("infir2.fp8_grouped_linear.") for o in ops) == 4  # 2 layers x (gate_up, down)
    assert sum(o.startswith("infir2.fp8_grouped_linear_backward.") for o in ops) == 4
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert isinstance(compiled.model.layers[0].mlp.experts, Fp8Experts)
    if plain_compile_is_exact(trainer=True):  # transformers 5.17 reorders the plain model's backward
        for eager, traced in zip(eager_grads, grads, strict=True):
            assert torch.equal(eager, traced)


@pytest.mark.slow
def test_tiny_moe_cpt_config_runs_as_shipped(tmp_path, monkeypatch):
    """The shipped MoE config: the demo's data, two steps, the FP8 export at the end loads."""
    from pathlib import Path

    import infir2
    from infir2.cli import main
    from infir2.export import load_checkpoint

    config = Path(infir2.__file__).parent / "configs" / "tiny-moe-cpt.yaml"
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--data-only", "--quick", "--out", "runs/tiny"]) == 0
    short = ["--no-progress", "--set", "train.max_steps=2", "--set", "run.device=cpu"]
    assert main(["train", str(config), *short]) == 0
    model = load_checkpoint(tmp_path / "runs/tiny-moe-cpt/hf")
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == 8


def _state_tensors(run_dir) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model and AdamW tensors (fp32 masters, moments) by name."""
    from infir2.checkpoint import latest_checkpoint, load_checkpoint

    state = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    tensors = {f"model.{k}": v for k, v in state["model"].items()}
    for pid, per_param in state["optimizer"]["state"].items():
        tensors.update({f"optim.{pid}.{k}": v for k, v in per_param.items() if isinstance(v, torch.Tensor)})
    return tensors


def _losses(run_dir) -> list[tuple[int, float]]:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


@pytest.mark.slow
def test_kill_9_of_a_tiny_moe_cpt_resumes_bit_identically(tmp_path, monkeypatch, caplog):
    """``infir2 train tiny-moe-cpt`` (FP8 experts, the demo's token shards) SIGKILLed once its second
    checkpoint exists, then the same command again: every loss and the final fp32 weights and AdamW
    moments equal the uninterrupted run's, bit for bit."""
    import logging
    import signal
    import subprocess
    import sys
    import time

    from infir2.cli import main
    from train_synthetic import subprocess_env

    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--data-only", "--quick", "--out", "runs/tiny"]) == 0
    short = {"run.device": "cpu", "data.seq_len": 64, "data.global_batch_size": 8, "data.micro_batch_size": 4}
    short |= {"train.max_steps": 8, "train.save_every": 1, "train.keep_last": 2, "train.eval_every": 4}
    sets = [a for k, v in short.items() for a in ("--set", f"{k}={v}")]
    command = ["train", "tiny-moe-cpt", "--no-progress", *sets]
    assert main([*command, "--set", "run.name=full"]) == 0  # the reference, uninterrupted

    killed = [sys.executable, "-m", "infir2.cli", *command, "--set", "run.name=killed"]
    proc = subprocess.Popen(killed, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    second = tmp_path / "runs/killed/checkpoints/step_00000002"
    deadline = time.monotonic() + 120
    while not second.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, out.decode()[-3000:]  # killed mid-run, not finished
    assert len(_losses(tmp_path / "runs/killed")) < 8
    with caplog.at_level(logging.INFO, logger="infir2"):
        assert main([*command, "--set", "run.name=killed"]) == 0
    resumed_at = [r.args[1] for r in caplog.records if r.getMessage().startswith("resumed from")]
    assert len(resumed_at) == 1 and resumed_at[0] >= 2  # from its newest checkpoint, not from scratch

    full, resumed = tmp_path / "runs/full", tmp_path / "runs/killed"
    reference = dict(_losses(full))
    assert {step for step, _ in _losses(resumed)} == set(reference) == set(range(1, 9))
    assert all(loss == reference[step] for step, loss in _losses(resumed))  # a step logged twice too
    ref, got = _state_tensors(full), _state_tensors(resumed)
    assert ref.keys() == got.keys() and any("experts.gate_up_proj" in k for k in ref)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
