"""FP8 numerics telemetry: its numbers against independent computations, planted defects ranked worst
by ``infir2 numerics``, and a run with telemetry off that records nothing and trains bit-identically."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import make_tiny_model
from infir2 import Fp8Linear, sqnr
from infir2.fp8 import dequantize, get_recipe, quantize
from infir2.nn.telemetry import OPERAND_STATS, SQNR_STAT, Fp8Telemetry, parse_key
from train_synthetic import SyntheticSource, one_thread, tiny_run_config

_one_thread = pytest.fixture(autouse=True)(one_thread)

OPERANDS = ("fprop.x", "fprop.w", "dgrad.dy", "dgrad.w", "wgrad.dy", "wgrad.x")
MASSIVE = 2.0**20  # a massive-activation token: 2**20 times its neighbours


def record_one_step(layer: Fp8Linear, x: torch.Tensor, grad: torch.Tensor) -> dict[str, float]:
    """Forward + backward of ``layer`` on ``x`` as one stats step; the telemetry by ``<op>/<stat>``."""
    telemetry = Fp8Telemetry(nn.Sequential(layer), every=1)
    with telemetry.record(1) as out:
        x = x.detach().clone().requires_grad_()
        layer(x).backward(grad)
    assert layer.stats is None  # detached when the step ends
    return {key.split("/", 2)[2]: value for key, value in out.items()}


def make_layer(
    recipe: str = "blockwise", k: int = 256, n: int = 384, weight_scale: float = 1.0, bias: bool = True
) -> Fp8Linear:
    torch.manual_seed(0)
    layer = Fp8Linear(k, n, bias=bias, recipe=recipe)
    with torch.no_grad():
        layer.weight.mul_(weight_scale)
    return layer


def test_operand_stats_and_sqnr_match_an_independent_computation():
    layer = make_layer()
    torch.manual_seed(1)
    x, grad = torch.randn(200, 256), torch.randn(200, 384) * 1e-3
    x[:, 5] = 0  # some zeros: underflow counts non-zero elements only
    stats = record_one_step(layer, x, grad)
    assert set(stats) == {f"{op}/{s}" for op in OPERANDS for s in OPERAND_STATS} | {
        f"{g}/{SQNR_STAT}" for g in ("fprop.y", "dgrad.dx", "wgrad.dw")
    }
    recipe = get_recipe("blockwise")
    for op, tensor, cast in (
        ("fprop.x", x, recipe.x),
        ("fprop.w", layer.weight, recipe.w),
        ("dgrad.dy", grad, recipe.dy),
        ("wgrad.x", x, recipe.x_wgrad),
    ):
        t = tensor.detach()
        data, scale_inv = quantize(t, cast.block, cast.fmt, cast.scale_encoding)  # the reference quantizer
        back = dequantize(data, scale_inv, cast.block)
        nonzero = t != 0
        assert stats[f"{op}/amax"] == pytest.approx(float(t.abs().max()))
        assert stats[f"{op}/underflow"] == pytest.approx(float((nonzero & (back == 0)).sum() / nonzero.sum()))
        saturated = float((data.float().abs() == torch.finfo(torch.float8_e4m3fn).max).sum()) / t.numel()
        assert stats[f"{op}/saturation"] == pytest.approx(saturated)
        assert stats[f"{op}/log2_scale_inv_max"] == float(torch.log2(scale_inv).max())
        assert stats[f"{op}/log2_scale_inv_min"] == float(torch.log2(scale_inv).min())
    # SQNR against fp64, computed here from the unquantized operands
    x64, w64, g64 = x.double(), layer.weight.detach().double(), grad.double()
    y = layer(x).detach()
    assert stats[f"fprop.y/{SQNR_STAT}"] == pytest.approx(
        sqnr(x64 @ w64.T + layer.bias.double(), y), abs=1e-3
    )
    assert 20 < stats[f"fprop.y/{SQNR_STAT}"] < 40
    assert 20 < stats[f"dgrad.dx/{SQNR_STAT}"] < 40
    assert 20 < stats[f"wgrad.dw/{SQNR_STAT}"] < 40
    assert stats[f"wgrad.dw/{SQNR_STAT}"] == pytest.approx(sqnr(g64.T @ x64, layer.weight.grad), abs=1e-3)


def test_pow2_scales_follow_a_small_weight_until_the_scale_is_clamped():
    """x 1e-12 does not underflow (the block scale grows with it); below ~448 / 2**127 it cannot grow."""
    torch.manual_seed(1)
    x, grad = torch.randn(128, 256), torch.randn(128, 384)
    base = record_one_step(make_layer(bias=False), x, grad)
    small = record_one_step(make_layer(weight_scale=1e-12, bias=False), x, grad)
    tiny = record_one_step(make_layer(weight_scale=1e-41, bias=False), x, grad)
    assert small["fprop.w/underflow"] <= base["fprop.w/underflow"] + 1e-3 < 0.01
    # the scales follow the weight
    assert small["fprop.w/log2_scale_inv_max"] < base["fprop.w/log2_scale_inv_min"] - 30
    assert abs(small[f"fprop.y/{SQNR_STAT}"] - base[f"fprop.y/{SQNR_STAT}"]) < 3
    assert tiny["fprop.w/underflow"] > 0.99
    assert tiny["fprop.w/log2_scale_inv_max"] == -127  # scale = 2**127, clamped
    assert tiny[f"fprop.y/{SQNR_STAT}"] < 1


@pytest.mark.parametrize(("recipe", "flushed"), [("tensorwise", True), ("blockwise", False)])
def test_a_massive_activation_token_flushes_its_neighbours_only_under_tensorwise(recipe, flushed):
    torch.manual_seed(1)
    x, grad = torch.randn(128, 256), torch.randn(128, 384)
    x[0] *= MASSIVE
    stats = record_one_step(make_layer(recipe), x, grad)
    assert (stats["fprop.x/underflow"] > 0.9) is flushed
    assert (stats["fprop.x/underflow"] < 0.01) is not flushed


def tiny_run(
    out_dir: Path,
    name: str,
    stats_every: int,
    recipe: str = "blockwise",
    steps: int = 2,
    plant: str | None = None,
):
    """A 2-step tiny training run; ``plant`` names a layer whose input gets a massive-activation token."""
    from infir2.train import train

    cfg = tiny_run_config(
        out_dir, name, fp8={"recipe": recipe, "stats_every": stats_every}, train={"max_steps": steps}
    )
    model = make_tiny_model("qwen2", hidden=192, layers=2, seed=0)
    with massive_token_into(model, plant) if plant else contextlib.nullcontext():
        result = train(cfg, model=model, train_source=SyntheticSource(seed=3), progress=False)
    return result, model


@contextlib.contextmanager
def massive_token_into(model: nn.Module, fqn: str):
    """A planted defect: the input of the layer at ``fqn`` gets its first token 2**20 times larger. A
    global hook, because training swaps the layer for an ``Fp8Linear`` (a hook on it would be lost)."""

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        if module is not model.get_submodule(fqn):
            return None
        x = args[0].clone()
        x[..., 0, :] *= MASSIVE
        return (x,)

    handle = nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def test_numerics_report_ranks_the_planted_layer_worst(tmp_path):
    from infir2.cli import main
    from infir2.tools.numerics import load_telemetry, worst

    planted = "model.layers.0.self_attn.o_proj"
    run, _ = tiny_run(tmp_path, "planted", stats_every=1, recipe="tensorwise", plant=planted)
    tel = load_telemetry(run.run_dir)
    assert tel.steps == [1, 2] and planted in tel.layers and len(tel.layers) == 14
    top = worst(tel, "underflow", lowest=False, top=3)
    assert top[0][0] == planted and top[0][1] in ("fprop.x", "wgrad.x") and top[0][2] > 0.9
    assert top[1][2] < 0.5 or top[1][0] == planted  # every other layer is far from it
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["numerics", str(run.run_dir), "--top", "3", "--out", str(tmp_path / "plots")]) == 0
    text = out.getvalue()
    underflow_table = text.split("highest underflow")[1].splitlines()
    assert underflow_table[2].split()[0] == planted  # title, header, then the worst row
    assert (tmp_path / "plots" / "numerics.png").stat().st_size > 0


def test_telemetry_off_records_nothing_and_training_is_bit_identical(tmp_path):
    off, model_off = tiny_run(tmp_path, "off", stats_every=0)
    on, model_on = tiny_run(tmp_path, "on", stats_every=2)
    assert not any(parse_key(k) for m in off.history for k in m)
    assert [bool(any(parse_key(k) for k in m)) for m in on.history] == [False, True]
    assert [m["loss"] for m in off.history] == [m["loss"] for m in on.history]
    for (name, p_off), p_on in zip(model_off.named_parameters(), model_on.parameters(), strict=True):
        assert torch.equal(p_off, p_on), name
    assert all(m.stats is None for m in model_on.modules() if isinstance(m, Fp8Linear))
    assert '"fp8/' not in (off.run_dir / "metrics.jsonl").read_text()


def test_numerics_errors_name_the_file(tmp_path):
    from infir2.tools.numerics import load_telemetry

    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl"):
        load_telemetry(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(ValueError, match="stats_every"):
        load_telemetry(tmp_path)


def test_numerics_help_teaches_how_to_record_and_read(capsys):
    from infir2.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["numerics", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for word in ("fp8.stats_every", "underflow", "saturation", "SQNR", "numerics.png"):
        assert word in text
