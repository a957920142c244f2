"""Routing replay (R3, ``algo.routing_replay: rollout``): the engine records each token's experts, the
trainer's MoE forward uses exactly those (a planted router tie), replaying agreeing routes changes nothing,
the routes travel through the batch, the checkpointed buffer and the context split, and a dense model's
run is the same with replay on or off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model, make_tokenizer
from infir2 import convert_to_fp8
from infir2.data.context import shard_micro_batch
from infir2.eval import GRADERS, Graded
from infir2.generation import BuiltinEngine, SamplingConfig
from infir2.generation.base import Prompt, Request
from infir2.harness.config import config_to_dict
from infir2.nn.moe import record_routes, replay_routes, routers
from infir2.rl import parse_rl_config, rl
from infir2.rl.batch import Group, RLBatch
from infir2.rl.context import as_micro_batch, row_routes
from moe_models import FAMILIES, moe_config
from rl_runs import fingerprint
from test_rl_loop import _config as loop_config
from train_synthetic import one_thread

pytestmark = pytest.mark.transformers_api  # the routers' output layout is transformers'

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _moe(family: str = "qwen3_moe", seed: int = 0, vocab: int = 256) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = moe_config(family)
    config.vocab_size = vocab
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).float().eval()


def _ids(rows: int = 2, length: int = 24, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _plant_tie(model: torch.nn.Module) -> None:
    """Every router: expert 0 scores ``h.w``, expert 1 ``-h.w``, experts 2 and 3 exactly 0: each token's
    top-2 is the positive one of 0 / 1 and one of the tied 2 / 3, a pick no logit decides."""
    for gate in routers(model):
        w = torch.randn(gate.weight.shape[1], generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            gate.weight.zero_()
            gate.weight[0], gate.weight[1] = w, -w


def test_replayed_routes_pick_exactly_the_recorded_experts_at_a_planted_tie():
    model = convert_to_fp8(_moe())  # blockwise FP8 experts (Fp8Experts)
    _plant_tie(model)
    ids = _ids()
    with record_routes(model, ids.shape[0]) as log:
        plain = _logits(model, ids)
    fresh = log.routes()
    assert fresh is not None and fresh.shape == (2, 24, 2, 2)
    tied = (fresh == 2) | (fresh == 3)
    assert bool((tied.sum(-1) == 1).all())  # every token took exactly one of the tied experts
    planted = torch.where(fresh == 2, 3, torch.where(fresh == 3, 2, fresh)).to(fresh.dtype)  # the other one

    seen = []
    hooks = [
        m.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone()))
        for m in model.modules()
        if hasattr(m, "experts") and hasattr(m, "gate")
    ]
    with replay_routes(model, planted) as stats:
        replayed = _logits(model, ids)
    for h in hooks:
        h.remove()
    for layer, got in enumerate(seen):  # the experts ran on exactly the recorded ids, in their order
        assert torch.equal(got, planted[:, :, layer].reshape(-1, 2).long())
    assert stats.counts.tolist() == [[48, 48], [48, 48]]  # every token's route differed before replay
    assert not torch.equal(replayed, plain)

    # independently: the model with experts 2 and 3 swapped, routed by its own (tie-broken) router,
    # computes with the same weights on the same rows: the same logits, bit for bit
    swapped = convert_to_fp8(_moe())
    _plant_tie(swapped)
    with torch.no_grad():
        for m in swapped.modules():
            if hasattr(m, "gate_up_proj") and m.gate_up_proj.dim() == 3:
                for p in (m.gate_up_proj, m.down_proj):
                    p[[2, 3]] = p[[3, 2]].clone()
    with record_routes(swapped, ids.shape[0]) as again:
        reference = _logits(swapped, ids)
    assert torch.equal(again.routes(), fresh)  # the swapped model's router broke the tie the same way
    assert torch.equal(replayed, reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_the_routers_own_routes_changes_nothing(family):
    model = _moe(family)
    ids = _ids()
    with record_routes(model, ids.shape[0]) as log:
        plain = _logits(model, ids)
    routes = log.routes()
    routes[0, :5] = -1  # tokens without a record: routed afresh
    with replay_routes(model, routes) as stats:
        again = _logits(model, ids)
    assert torch.equal(again, plain)
    assert stats.counts[:, 1].sum() == 0 and stats.counts[:, 0].tolist() == [43] * routes.shape[2]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_replayed_weights_are_the_routers_formula_at_the_replayed_experts(family):
    """A single MoE block, replayed to other experts: its output equals the experts module called with
    weights computed here in fp64 from the router's logits (softmax or sigmoid, renormalised, scaled)."""
    model = _moe(family)
    block = next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate"))
    x = torch.randn(1, 6, 128, generator=torch.Generator().manual_seed(1))
    index = torch.tensor([[3, 1], [0, 2], [2, 3], [1, 0], [3, 0], [2, 1]])
    with torch.no_grad(), replay_routes(block, index.reshape(1, 6, 1, 2).to(torch.int16)):
        got = block(x)
        logits = block.gate(x.reshape(6, 128))[0].double()
    gate = block.gate
    if family == "deepseek_v3":
        w = logits.sigmoid().gather(1, index)
        w = w / w.sum(-1, keepdim=True) * gate.routed_scaling_factor
    else:
        w = logits.softmax(-1).gather(1, index)
        w = w / w.sum(-1, keepdim=True) if getattr(gate, "norm_topk_prob", True) else w
    with torch.no_grad():
        expected = block.experts(x.reshape(6, 128), index, w.float())
        if family == "deepseek_v3":
            expected = expected + block.shared_experts(x).reshape(6, 128)
    torch.testing.assert_close(got.reshape(6, 128), expected, rtol=1e-5, atol=1e-6)


def test_the_engine_records_what_the_trainers_forward_routes():
    """At high precision on the same weights, the routes the built-in engine records for each sample equal
    the routes of one whole forward over prompt + response (a column off would differ almost everywhere)."""
    model, tok = _moe(vocab=300), make_tokenizer()
    engine = BuiltinEngine(model, tok, precision="high", copy_model=True, record_routes=True)
    prompts = [Prompt([5, 6, 7, 8, 9], None, (1, 2)), Prompt([11, 12, 13], None, (3,))]
    out = engine.generate(Request(prompts, SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=6)))
    for prompt, samples in zip(prompts, out, strict=True):
        for s in samples:
            ids = torch.tensor([prompt.ids + s.response_ids])
            assert s.routes is not None and s.routes.shape == (ids.shape[1], 2, 2)
            assert bool((s.routes[-1] == -1).all()) and bool((s.routes[:-1] >= 0).all())
            with record_routes(model, 1) as log:
                _logits(model, ids)
            whole = log.routes()[0]
            assert torch.equal(s.routes[:-1].sort(-1).values, whole[:-1].sort(-1).values)


def test_routes_of_forwards_that_are_not_one_column_per_token_are_refused():
    from infir2.generation.base import Sample
    from infir2.generation.builtin import sample_routes

    samples = [Sample([1, 2, 3], [0.0] * 3, True), Sample([4], [0.0], True)]
    sample_routes(torch.zeros(2, 4 + 2, 2, 2, dtype=torch.int16), [[5] * 4, [6] * 2], samples)  # 4 + 3 - 1
    assert samples[0].routes.shape == (7, 2, 2) and samples[1].routes.shape == (3, 2, 2)
    assert bool((samples[1].routes[:2] == 0).all()) and bool((samples[1].routes[2:] == -1).all())
    with pytest.raises(
        RuntimeError, match="not one column per token fed"
    ):  # e.g. a whole-sequence forward per step
        sample_routes(torch.zeros(2, 4 + 3 + 4, 2, 2, dtype=torch.int16), [[5] * 4, [6] * 2], samples)


def _group(prompt: int, plen: int, lengths: list[int]) -> Group:
    routes = [torch.randint(0, 4, (plen + n, 2, 2), dtype=torch.int16) for n in lengths]
    responses = [list(range(1, n + 1)) for n in lengths]
    logprobs = torch.zeros(len(lengths), max(lengths))
    n = len(lengths)
    return Group(prompt, lengths, [True] * n, [0.0] * n, [0.0] * n, responses, logprobs, routes)


def test_routes_travel_through_the_buffer_record_the_batch_and_the_context_split():
    groups = [_group(0, 3, [4, 2]), _group(1, 5, [3, 1])]
    back = [Group.from_record(g.to_record()) for g in groups]
    assert all(
        torch.equal(a, b)
        for g, h in zip(groups, back, strict=True)
        for a, b in zip(g.routes, h.routes, strict=True)
    )
    prompts = [[7] * 3, [8] * 5]
    batch = RLBatch.build(prompts, back, torch.zeros(2, 2), False, 0)
    rows = batch.rows([0, 3])  # group 0's first response, group 1's second: prompt 5 wide, response 4
    assert rows.routes.shape == (2, 9, 2, 2)
    assert torch.equal(rows.routes[0, 2:9], groups[0].routes[0]) and bool((rows.routes[0, :2] == -1).all())
    assert torch.equal(rows.routes[1, :6], groups[1].routes[1]) and bool((rows.routes[1, 6:] == -1).all())

    # the context split cuts the routes where it cuts the tokens: route "ids" equal to the token ids
    rows.routes = rows.ids[:, :, None, None].expand(-1, -1, 2, 2).to(torch.int16)
    for rank in range(2):
        shard = shard_micro_batch(as_micro_batch(rows), rank, 2)
        part = type("Part", (), {"batch": shard})()
        got = row_routes(rows, part)  # type: ignore[arg-type]
        assert got.shape[:2] == shard["input_ids"].shape
        columns = int(shard["context_start"]) + torch.arange(got.shape[1])
        inside = columns < rows.ids.shape[1]  # past the row: the split's padding, routed afresh
        assert torch.equal(got[:, inside, 0, 0].long(), shard["input_ids"][:, inside])
        assert bool((got[:, ~inside] == -1).all()) and bool((~inside).any())
    assert row_routes(rows, None) is rows.routes


def test_replay_config_key_is_checked():
    base = {"data": {"prompts_path": "p.jsonl"}}
    with pytest.raises(ValueError, match=r"x\.yaml: algo\.routing_replay"):
        parse_rl_config({**base, "algo": {"routing_replay": "old"}}, "x.yaml")
    with pytest.raises(
        ValueError, match=r"routing_replay: rollout needs rollout\.engine: builtin \(infir2's vllm engine"
    ):
        parse_rl_config(
            {**base, "algo": {"routing_replay": "rollout"}, "rollout": {"engine": "vllm"}}, "x.yaml"
        )


def _config(tmp_path, name, replay, **sections):
    """``test_rl_loop``'s run (FP8 rollouts of the identical pair, blockwise training, a carried-over
    buffer, two updates a step) with ``algo.routing_replay: replay``."""
    return loop_config(
        tmp_path, name, algo={"routing_replay": replay, **sections.pop("algo", {})}, **sections
    )


@pytest.fixture
def parity_reward(monkeypatch):
    monkeypatch.setitem(GRADERS, "parity", lambda problem, text: Graded(None, len(text) % 2 == 1))


def test_a_dense_models_run_is_bit_identical_with_replay_on_or_off(tmp_path, parity_reward):
    tok = make_tokenizer()
    for replay in ("off", "rollout"):
        rl(_config(tmp_path, replay, replay), model=make_tiny_model(seed=1), tokenizer=tok, progress=False)
    off, on = fingerprint(tmp_path / "off"), fingerprint(tmp_path / "rollout")
    assert off[0] == on[0] and not any(k.startswith("routing/") for m in on[0] for k in m)
    assert off[1].keys() == on[1].keys() and all(torch.equal(off[1][k], on[1][k]) for k in off[1])


def test_a_moe_run_with_replay_logs_the_routing_metrics(tmp_path, parity_reward):
    cfg = _config(tmp_path, "moe", "rollout", rollout={"base_dtype": "bf16"})  # bf16: some routes differ
    result = rl(cfg, model=_moe(vocab=300), tokenizer=make_tokenizer(), progress=False)
    for m in result.history:
        shares = [m[f"routing/differ_share/layer{i}"] for i in range(2)]
        assert all(0 <= s < 0.5 for s in shares)
        assert m["routing/differ_share"] == pytest.approx(sum(shares) / 2)  # every layer sees every token
    assert any(m["routing/differ_share"] > 0 for m in result.history)


#: a child ``infir2 rl`` (the parity reward registered first) that SIGKILLs itself in step 3's update
_KILLED_RL = """
import os, signal, sys
from infir2.cli import main
from infir2.eval import GRADERS, Graded
from infir2.rl import loop
GRADERS["parity"] = lambda problem, text: Graded(None, len(text) % 2 == 1)
update, calls = loop.update, []
def killed(*args):
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return update(*args)
loop.update = killed
sys.exit(main(["rl", sys.argv[1], "--no-progress"]))
"""


def _tiny_moe_rl_yaml(tmp_path, name: str, replay: str) -> str:
    """``infir2 rl`` on the shipped tiny MoE (``tiny-moe-cpt``'s model): FP8 rollouts, blockwise FP8
    training and experts, bf16 rollout embeddings (so that some routes differ), routing replay
    ``replay``, a checkpoint every step, a carried-over buffer."""
    import yaml

    from infir2.harness.config import resolve_config_path

    model = yaml.safe_load(resolve_config_path("tiny-moe-cpt").read_text())["model"]
    if not (tmp_path / "tok").is_dir():
        make_tokenizer().save_pretrained(tmp_path / "tok")
    train = {"max_steps": 4, "save_every": 1, "keep_last": 4}
    data = config_to_dict(_config(tmp_path, name, replay, train=train, rollout={"base_dtype": "bf16"}))
    data["model"] = {**model, "tokenizer": str(tmp_path / "tok")}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("replay", ["off", "rollout"])
def test_kill_9_of_infir2_rl_on_the_tiny_moe_resumes_bit_identically(tmp_path, parity_reward, replay):
    """``infir2 rl`` SIGKILLed in its third step's update (after step 2's checkpoint), then the same command
    again: every metric (the routing ones included) and the final weights and AdamW state equal the
    uninterrupted run's, bit for bit; with replay the checkpointed buffer carried routes."""
    import signal
    import subprocess
    import sys

    from infir2.cli import main
    from train_synthetic import subprocess_env

    assert main(["rl", _tiny_moe_rl_yaml(tmp_path, "whole", replay), "--no-progress"]) == 0
    killed = _tiny_moe_rl_yaml(tmp_path, "killed", replay)
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_RL, killed], env=subprocess_env(), capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # killed in step 3's update
    assert main(["rl", killed, "--no-progress"]) == 0
    whole, resumed = fingerprint(tmp_path / "whole"), fingerprint(tmp_path / "killed")
    assert resumed[0] == whole[0]
    assert all(("routing/differ_share" in m) == (replay == "rollout") for m in whole[0])
    assert whole[1].keys() == resumed[1].keys() and any("experts.gate_up_proj" in k for k in whole[1])
    assert all(torch.equal(whole[1][k], resumed[1][k]) for k in whole[1])
    saved = [
        torch.load(c / "state.pt", weights_only=True)
        for c in (tmp_path / "killed/checkpoints").glob("step_*")
    ]
    records = [r for s in saved for r in s["data"][0]["buffer"] if "responses" in r]
    assert records and all(("routes" in r) == (replay == "rollout") for r in records)
    assert all(r["routes"][0].dtype == torch.int16 for r in records if "routes" in r)  # crossed checkpoints


@pytest.mark.slow
def test_replay_under_context_parallelism_routes_as_one_process(tmp_path, monkeypatch):
    """``parallel.context: 2`` on the tiny MoE with replay: each rank replays the routes of its own tokens
    of every row (``rl.context.row_routes``), so the first step's scoring -- the routes that differed,
    layer by layer, the entropy and the mismatch -- is one process's."""
    from infir2.cli import main
    from rl_distributed_worker import parity
    from test_rl_distributed import _config as distributed_config
    from test_rl_distributed import _metrics
    from train_synthetic import torchrun

    monkeypatch.setitem(GRADERS, "parity", parity)
    tok = make_tokenizer()
    cfg = distributed_config(tmp_path, tok)
    moe = tmp_path / "moe"
    _moe(vocab=300, seed=1).save_pretrained(moe)
    tok.save_pretrained(moe)
    sets = [
        "model.path=" + str(moe),
        "algo.routing_replay=rollout",
        "train.max_steps=1",
        "rollout.base_dtype=bf16",
    ]
    args = [a for s in sets for a in ("--set", s)]
    worker = Path(__file__).parent / "rl_distributed_worker.py"
    torchrun(worker, "--no-engine-check", cfg, *args, "--set", "parallel.context=2", "--set", "run.name=cp")
    assert main(["rl", str(cfg), "--no-progress", *args, "--set", "run.name=one"]) == 0
    two, one = (_metrics(tmp_path / "runs" / name)[0] for name in ("cp", "one"))
    routing = [k for k in one if k.startswith("routing/")]
    assert len(routing) == 3 and one["routing/differ_share"] > 0  # bf16 rollouts: some routes differ
    assert {k: two[k] for k in routing} == {k: one[k] for k in routing}
    for key in ("entropy", "mismatch/abs_dlogp_mean", "mismatch/k3_kl"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
