"""infir2 plan: its terms against bytes measured on tiny models (within 10%), and the CLI."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from conftest import make_tiny_model
from infir2.cli import main
from infir2.harness.optim import build_optimizer
from infir2.loss import lm_loss_sum
from infir2.nn import cache_fp8_weights, convert_to_fp8, recompute_rmsnorm, recompute_swiglu
from infir2.planning import MODELS, ModelShape, layer_figures, load_shape, plan
from infir2.tools.memory import saved_in_graph
from infir2.train.config import parse_config
from live_bytes import LiveBytes
from train_synthetic import one_thread

_one_thread = pytest.fixture(autouse=True)(one_thread)

BATCH, SEQ = 2, 128


def _shape(model) -> ModelShape:
    return ModelShape.from_config(model.config.to_dict(), "<tiny>")


def saved_bytes(model, ids: torch.Tensor, chunk_tokens: int | None = None, autocast: bool = True) -> int:
    """Bytes the forward of ``lm_loss_sum`` (FP8 weight cache on; bf16 autocast unless not ``autocast``)
    keeps for backward, outside the parameters' storage."""
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with cast, cache_fp8_weights(model):
        loss = lm_loss_sum(model, ids, ids, chunk_tokens=chunk_tokens)
        params = {t.untyped_storage().data_ptr() for t in model.parameters()}
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for _, t in saved_in_graph(loss.grad_fn)
        }
    return sum(n for ptr, n in storages.items() if ptr not in params)


def _within(planned: float, measured: float, tol: float = 0.10) -> None:
    assert abs(planned / measured - 1) <= tol, (planned, measured)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "fp8"])
def test_states_match_the_tensors_after_one_step(state_dtype: str) -> None:
    model = make_tiny_model(hidden=128)
    shape = _shape(model)
    assert shape.params == sum(p.numel() for p in model.parameters())
    opt = build_optimizer(model, parse_config({"optim": {"state_dtype": state_dtype}}, "<t>").optim)
    ids = torch.randint(0, 300, (BATCH, SEQ))
    lm_loss_sum(model, ids, ids, chunk_tokens=None).backward()
    opt.step()
    p = plan(shape, "bf16", gpus=1, seq_len=SEQ, micro_batch=BATCH, state_dtype=state_dtype)
    _within(p.parameters, sum(t.numel() * t.element_size() for t in model.parameters()))
    _within(p.gradients, sum(t.grad.numel() * t.grad.element_size() for t in model.parameters()))
    moments = sum(
        t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step"
    )
    _within(p.optimizer, moments)


@pytest.mark.parametrize(
    ("recipe", "chunk", "recompute", "norm"),
    [
        ("bf16", 0, True, True),
        ("blockwise", 0, True, True),
        ("blockwise", 64, True, True),
        ("blockwise", 0, False, False),
        ("blockwise", 0, True, False),
        ("blockwise", 0, "fp8", True),
    ],
)
def test_saved_bytes_match_a_whole_tiny_model(
    recipe: str, chunk: int, recompute: bool | str, norm: bool
) -> None:
    """Activations + logits + weight copies of the plan == what a whole model's forward keeps
    (``recompute="fp8"``: the SwiGLU recompute keeping its inputs in FP8, model.mlp_saved_fp8)."""
    model = make_tiny_model(hidden=128, layers=3)
    if recompute:  # as training does by default (model.recompute_mlp)
        recompute_swiglu(model, fp8_saved=recompute == "fp8")
    if norm:  # likewise (model.recompute_norm)
        recompute_rmsnorm(model)
    if recipe != "bf16":
        convert_to_fp8(model, recipe)
    measured = saved_bytes(model, torch.randint(0, 300, (BATCH, SEQ)), chunk or None)
    p = plan(
        _shape(model),
        recipe,
        gpus=1,
        seq_len=SEQ,
        micro_batch=BATCH,
        loss_chunk_tokens=chunk,
        recompute_mlp=bool(recompute),
        recompute_norm=norm,
        mlp_saved_fp8=recompute == "fp8",
    )
    _within(p.activations + p.logits_saved + p.weight_copies, measured)


@pytest.mark.parametrize(("precision", "device"), [("fp32", "cpu"), ("bf16", "cuda")])
def test_chunked_logits_in_backward_are_what_a_tiny_models_backward_holds(precision: str, device: str):
    """The plan's chunked-loss backward term == the most ``[*, V]`` bytes a tiny model's backward of
    ``lm_loss_sum`` holds at once (counted per allocation): fp32 on a CPU, bf16 autocast as on a GPU."""
    vocab, hidden, chunk = 2048, 64, 32
    model = make_tiny_model(vocab_size=vocab, hidden=hidden, layers=1)
    ids = torch.randint(0, vocab, (BATCH, SEQ + 1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = lm_loss_sum(model, ids, ids, chunk_tokens=chunk)
    counted = LiveBytes(vocab, hidden)
    with counted:
        loss.backward()
    p = plan(
        _shape(model),
        "bf16",
        seq_len=SEQ,
        micro_batch=BATCH,
        loss_chunk_tokens=chunk,
        precision=precision,
        device=device,
    )
    assert p.logits_backward == counted.peak, (p.logits_backward, counted.peak)


def test_shipped_shapes_and_config_json(tmp_path) -> None:
    name, shape = load_shape("Qwen2.5-1.5B")
    assert name == "qwen2.5-1.5b" and 1.5e9 < shape.params < 1.6e9  # 1.54B, tied embeddings
    assert 7.5e9 < load_shape("qwen2.5-7b")[1].params < 7.7e9  # 7.62B
    (tmp_path / "config.json").write_text(json.dumps(MODELS["qwen2.5-7b"]))
    assert load_shape(str(tmp_path))[1] == load_shape("qwen2.5-7b")[1]
    (tmp_path / "bad.json").write_text("{\n  oops")
    with pytest.raises(ValueError, match=r"bad\.json: line 2"):
        load_shape(str(tmp_path / "bad.json"))


def _projection_elements(model) -> int:
    """Elements of one decoder layer's ``nn.Linear`` weights, counted on the model itself."""
    layer = model.model.layers[0]
    return sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral", "qwen3"])
def test_parameters_with_a_head_dim_other_than_hidden_over_heads(arch: str) -> None:
    """head_dim 48 (not 128 / 4): the plan's parameters == the model's, exactly, and its projection
    weights == the layer's linear weights (q / k / v biases: Qwen2 only; Qwen3's q / k norms)."""
    model = make_tiny_model(arch, hidden=128, heads=4, kv_heads=2, head_dim=48)
    assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 48  # the config took it
    shape = _shape(model)
    assert shape.head_dim == 48
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.projection_weights == _projection_elements(model)


def test_activations_with_a_head_dim_other_than_hidden_over_heads() -> None:
    """The layer the plan measures has the model's head width: weight copies are the projections'
    exactly (bf16 casts), and activations + logits + weight copies match a whole model's (10%)."""
    model = make_tiny_model("llama", hidden=128, layers=3, head_dim=96)
    recompute_swiglu(model)
    recompute_rmsnorm(model)
    shape = _shape(model)
    p = plan(shape, "bf16", gpus=1, seq_len=SEQ, micro_batch=BATCH, loss_chunk_tokens=0)
    assert p.weight_copies == shape.layers * 2 * _projection_elements(model) + 2 * shape.vocab * shape.hidden
    _within(
        p.activations + p.logits_saved + p.weight_copies,
        saved_bytes(model, torch.randint(0, 300, (BATCH, SEQ))),
    )


def test_cli_prints_bf16_and_fp8_side_by_side(tmp_path, capsys) -> None:
    config = make_tiny_model(hidden=128).config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config, default=str))
    assert main(["plan", str(tmp_path), "--gpus", "2", "--seq-len", "256", "--state-dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "activations" in out and "all_gather /step" in out and "fp8/bf16" in out
    assert main(["plan", str(tmp_path), "--recipe", "nope"]) == 2


def test_embedded_figures_are_what_infir2_memory_measures() -> None:
    """The shipped 1.5B row of MEASURED == a fresh measurement (small shape-preserving check: weights)."""
    from infir2.planning import MEASURED

    shape = load_shape("qwen2.5-1.5b")[1]
    projections = shape.layer_params - 2 * shape.hidden - (shape.hidden + 2 * 256)  # minus norms and biases
    assert projections == shape.projection_weights
    layer = (shape.hidden, shape.intermediate, shape.heads, shape.kv_heads)
    for recompute in ((False, False), (True, False), (True, True)):
        row = MEASURED[(*layer, *recompute, False)]
        assert row["bf16"][1] == 2 * projections  # autocast's bf16 copies
        assert projections < row["blockwise"][1] < projections * 1.001  # FP8 copies + 128x128 scales
    # the MLP recompute drops exactly silu(g): one bf16 [T, I] tensor, 2 I bytes per token
    plain, recomputed, norms = (
        MEASURED[(*layer, *r, False)] for r in ((False, False), (True, False), (True, True))
    )
    for recipe in recomputed.keys() & plain.keys():
        assert plain[recipe][0] - recomputed[recipe][0] == 2 * shape.intermediate, recipe
    # the norm recompute drops exactly each norm's normalized output: two fp32 [T, H] tensors, 8 H bytes
    assert recomputed.keys() == norms.keys()
    for recipe in norms:
        assert recomputed[recipe][0] - norms[recipe][0] == 2 * 4 * shape.hidden, recipe
    # model.mlp_saved_fp8 (measured now, not embedded): the bf16 gate and up outputs become E4M3 codes and
    # an fp32 scale per 128 elements: 2 x (2 - 1 - 4 / 128) I bytes per token fewer
    fp8_saved, _ = layer_figures(shape, "blockwise", mlp_saved_fp8=True)
    assert norms["blockwise"][0] - fp8_saved == 2 * (shape.intermediate - 4 * shape.intermediate // 128)


@pytest.mark.parametrize("recipe", ["bf16", "blockwise"])
def test_a_cpu_run_is_planned_as_it_runs(recipe: str, tmp_path, capsys) -> None:
    """``device="cpu"``: fp32 without autocast (no bf16 weight or lm_head copies), the FP8 weight cache
    holding 1 byte per projection weight; activations + logits + weight copies == a tiny model's."""
    model = make_tiny_model(hidden=128, layers=3)
    recompute_swiglu(model)
    recompute_rmsnorm(model)
    if recipe != "bf16":
        convert_to_fp8(model, recipe)
    measured = saved_bytes(model, torch.randint(0, 300, (BATCH, SEQ)), autocast=False)  # a CPU run in fp32
    shape = _shape(model)
    p = plan(shape, recipe, gpus=1, seq_len=SEQ, micro_batch=BATCH, loss_chunk_tokens=0, device="cpu")
    _within(p.activations + p.logits_saved + p.weight_copies, measured)
    codes = shape.layers * shape.projection_weights
    assert p.weight_copies == 0 if recipe == "bf16" else codes < p.weight_copies < 1.01 * codes
    gpu = plan(shape, recipe, gpus=1, seq_len=SEQ, micro_batch=BATCH, loss_chunk_tokens=0)
    assert p.activations > gpu.activations  # fp32, not bf16
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict(), default=str))
    assert main(["plan", str(tmp_path), "--gpus", "1", "--device", "cpu", "--seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "per process (GiB)" in out and "fp8/fp32" in out and "fp32 emulation" in out


def test_a_plan_that_does_not_fit_its_gpu_says_so_and_what_would(capsys):
    """qwen2.5-7b at 32k without activation checkpointing is far over an H100; each way out is planned."""
    from infir2.cli import main

    assert main(["plan", "qwen2.5-7b", "--gpus", "8", "--seq-len", "32768"]) == 0
    *_, last, fits = capsys.readouterr().out.strip().splitlines()
    assert last.startswith("warning: does not fit a H100 (80 GiB"), last
    assert "activation checkpointing (" in last and "--seq-len 8192 (" in last
    assert fits.endswith("blockwise, these options: none of 1 to 64 GPUs"), fits  # activations do not shard
    assert (
        main(["plan", "qwen2.5-7b", "--gpus", "8", "--seq-len", "32768", "--activation-checkpointing"]) == 0
    )
    *_, last, fits = capsys.readouterr().out.strip().splitlines()
    assert last.startswith("fits a H100 (80 GiB)") and fits.endswith("blockwise, these options: 4 GPUs"), fits
