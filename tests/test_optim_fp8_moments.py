"""optim.state_dtype: fp8 -- AdamW moments as block-scaled FP8 codes (``infir2.fp8.moments``, ``Fp8AdamW``).

The rule against a float64 reference written from the rule's text (its own rounding to the FP8 grid),
the bytes counted from the tensors, the update against torch's AdamW, a state-dict round trip, and a
training run killed with SIGKILL and resumed bit for bit.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from conftest import make_tiny_model
from infir2.checkpoint import load_checkpoint
from infir2.fp8.moments import MAX_EXPONENT, dequantize_moment, quantize_moment
from infir2.harness.optim import Fp8AdamW, build_optimizer
from infir2.train import train
from infir2.train.config import parse_config
from train_synthetic import SyntheticSource, killed_and_resumed, one_thread, regression_steps, tiny_run_config

_one_thread = pytest.fixture(autouse=True)(one_thread)

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
#: (mantissa bits, smallest normal exponent, max) of the two formats
GRID = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0)}


def _to_grid(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 round-to-nearest-even onto the FP8 grid of ``fmt`` (saturating), from frexp."""
    man, emin, fmax = GRID[fmt]
    a = x.abs()
    _, e = torch.frexp(a)  # a = f * 2**e, f in [0.5, 1): the leading bit is 2**(e - 1)
    ulp = torch.exp2((torch.clamp(e - 1, min=emin) - man).double())
    return (torch.round(a / ulp) * ulp).clamp(max=fmax) * x.sign()


def _f32(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to fp32 and back (what one fp32 operation of exact inputs returns)."""
    return x.float().double()


def _reference(x: torch.Tensor, kind: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes' values, dequantized moment) by the module doc's rule, in float64 with fp32 roundings."""
    fmt = "e5m2" if kind == "e5m2" else "e4m3"
    rows = x.double().reshape(-1, x.shape[-1])
    if kind == "sqrt_e4m3":
        rows = _f32(rows.sqrt())
    k = rows.shape[1]
    codes, out = torch.empty_like(rows), torch.empty_like(rows)
    for start in range(0, k, block):
        part = rows[:, start : start + block]
        amax = part.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, _f32(GRID[fmt][2] / amax), 1.0)
        q = _to_grid(_f32(part * scale), fmt)
        codes[:, start : start + block] = q
        out[:, start : start + block] = _f32(q * _f32(1 / scale))
    if kind == "sqrt_e4m3":
        out = _f32(out * out)
    return codes.reshape(x.shape), out.reshape(x.shape).float()


def _moment(shape: tuple[int, ...], seed: int, positive: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) ** 6 * 1e-3  # wide range, like g^2
    x[0, :5] = 0.0
    return x * x if positive else x


@pytest.mark.parametrize("kind", ["m", "e5m2", "sqrt_e4m3"])
@pytest.mark.parametrize("block", [128, 48])
def test_moments_quantize_and_dequantize_as_a_float64_reference(kind: str, block: int) -> None:
    x = _moment((6, 200), seed=block, positive=kind != "m")  # 200: a partial last block either way
    stored = quantize_moment(x, kind, block)
    fmt = torch.float8_e5m2 if kind == "e5m2" else torch.float8_e4m3fn
    codes, expected = _reference(x, kind, block)
    assert stored.codes.dtype == torch.uint8 and stored.scale_inv.shape == (6, math.ceil(200 / block))
    assert torch.equal(stored.codes.view(fmt).double(), codes)
    assert torch.equal(dequantize_moment(stored, kind, block), expected)


def test_range_expansion_exponent_is_coats_and_helps_a_narrow_block() -> None:
    g = torch.Generator().manual_seed(0)
    narrow = 1e-3 * (1 + torch.rand(4, 128, generator=g))  # every value within a factor of 2
    wide = _moment((4, 128), seed=1, positive=True)
    for x in (narrow, wide):
        stored = quantize_moment(x, "m", 128, expand=True)
        mag = x.double().abs()
        ratio = mag.amax(1) / torch.where(mag > 0, mag, math.inf).amin(1)
        k = (math.log(448 / 2**-6) / ratio.log()).clamp(1, MAX_EXPONENT)
        torch.testing.assert_close(stored.exponent.double().flatten(), k, rtol=1e-6, atol=0)
    plain = (dequantize_moment(quantize_moment(narrow, "m", 128), "m", 128) - narrow).abs().mean()
    expanded = (dequantize_moment(quantize_moment(narrow, "m", 128, True), "m", 128) - narrow).abs().mean()
    assert expanded < 0.5 * plain  # k = 8: the block spans the format's exponents, not one of them


def _model(seed: int = 0, bias: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 64, bias=bias), nn.ReLU(), nn.Linear(64, 4, bias=bias))


@pytest.mark.parametrize("expand", [False, True])
def test_bytes_per_parameter_counted_from_the_tensors(expand: bool) -> None:
    """fp32 master + fp32 grad (8 bytes) + two moments of 1 byte and one fp32 scale per 128 elements of a
    row (and one exponent with expansion): 8 + 2 + 8/128 = 10.0625 bytes per parameter (+ 8/128)."""
    cfg = parse_config({"optim": {"state_dtype": "fp8", "fp8_range_expansion": expand}}, "<test>")
    model = nn.Linear(256, 64, bias=False)
    opt = build_optimizer(model, cfg.optim)
    assert isinstance(opt, Fp8AdamW)
    predicted = opt.state_bytes(model.weight)
    regression_steps(nn.Sequential(model, nn.Linear(64, 4)), opt, range(1))
    state = opt.state[model.weight]
    moments = sum(t.numel() * t.element_size() for k, t in state.items() if k != "step")
    assert (8 * model.weight.numel() + moments) / model.weight.numel() == 10.0625 + (0.0625 if expand else 0)
    assert predicted == moments + 4  # and the fp32 step counter


def test_one_dimensional_parameters_keep_fp32_moments() -> None:
    model = _model()
    opt = Fp8AdamW(model.parameters(), **HYPER)
    regression_steps(model, opt, range(1))
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.uint8
    assert opt.state[model[0].bias]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("second", ["sqrt_e4m3", "e5m2"])
def test_fp8_moments_track_fp32_moments(second: str) -> None:
    """20 steps of a small regression: the weights' distance from torch's AdamW is a few percent of how
    far they moved (bound 15%; bf16 moments: under 2%, COAT's expansion halves the FP8 figure), and not zero."""
    a, b = _model(), _model()
    regression_steps(a, torch.optim.AdamW(a.parameters(), **HYPER), range(20))
    regression_steps(b, Fp8AdamW(b.parameters(), **HYPER, second_moment=second), range(20))
    for p0, pa, pb in zip(_model().parameters(), a.parameters(), b.parameters(), strict=True):
        moved = (pa - p0).norm()
        assert 0 < (pa - pb).norm() < 0.15 * moved


@pytest.mark.parametrize("expand", [False, True])
def test_state_dict_round_trip_resumes_exactly(expand: bool) -> None:
    """3 steps, save, load into a fresh model + optimizer, 3 more == 6 in one go, bit for bit; the codes
    load as uint8 (torch's loader alone would cast them to fp32)."""
    ref = _model()
    regression_steps(ref, Fp8AdamW(ref.parameters(), **HYPER, expand=expand), range(6))
    first = _model()
    opt = Fp8AdamW(first.parameters(), **HYPER, expand=expand)
    regression_steps(first, opt, range(3))
    saved_model, saved_opt = copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = _model(seed=1)
    resumed.load_state_dict(saved_model)
    opt2 = Fp8AdamW(resumed.parameters(), **HYPER, expand=expand)
    opt2.load_state_dict(saved_opt)
    assert opt2.state[resumed[0].weight]["exp_avg"].dtype == torch.uint8
    regression_steps(resumed, opt2, range(3, 6))
    for pa, pb in zip(ref.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_fp32_moments_load_as_fp8_codes() -> None:
    """A run that switches optim.state_dtype from fp32 to fp8: the loaded moments are stored as codes."""
    model = _model()
    adamw = torch.optim.AdamW(model.parameters(), **HYPER)
    regression_steps(model, adamw, range(2))
    opt = Fp8AdamW(model.parameters(), **HYPER)
    opt.load_state_dict(adamw.state_dict())
    state, fp32 = opt.state[model[0].weight], adamw.state[model[0].weight]
    assert state["exp_avg"].dtype == torch.uint8 and float(state["step"]) == 2
    m, _ = opt._read(state, slice(None))
    assert torch.equal(m, dequantize_moment(quantize_moment(fp32["exp_avg"], "m", 128), "m", 128))


@pytest.mark.slow
@pytest.mark.parametrize(
    "optim",
    [
        {"state_dtype": "fp8"},
        {"state_dtype": "fp8", "fp8_second_moment": "e5m2", "fp8_range_expansion": True, "fp8_block": 32},
        {"state_dtype": "fp8", "grad_dtype": "bf16"},
    ],
)
def test_fp8_moments_resume_identically_after_kill_9(tmp_path, optim) -> None:
    """Killed by SIGKILL after step 3's checkpoint and resumed in this process: the losses, weights and
    stored moments of 6 uninterrupted steps, bit for bit."""
    resumed, full = killed_and_resumed(tmp_path, {"optim": {"lr": 3e-3, **optim}})
    assert [m["loss"] for m in resumed.history] == [m["loss"] for m in full.history[3:]]
    a, b = load_checkpoint(full.checkpoint), load_checkpoint(resumed.checkpoint)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    states = a["optimizer"]["state"], b["optimizer"]["state"]
    codes = [t for s in states[0].values() for t in s.values() if t.dtype == torch.uint8]
    assert codes, "no FP8 codes in the checkpoint"
    for key, state in states[0].items():
        assert all(torch.equal(t, states[1][key][k]) for k, t in state.items()), key


def test_fp8_moments_resumed_with_another_state_dtype_are_refused(tmp_path) -> None:
    """torch's loader would read the codes as numbers (0..255) without complaint: refused, naming the key."""
    kw = {"train": {"max_steps": 2, "save_every": 2}, "optim": {"lr": 3e-3, "state_dtype": "fp8"}}
    train(
        tiny_run_config(tmp_path, "run", **kw),
        model=make_tiny_model(),
        train_source=SyntheticSource(seed=1),
        progress=False,
    )
    for other in ("fp32", "bf16"):
        more = {
            "train": {"max_steps": 4},
            "optim": {"lr": 3e-3, "state_dtype": other},
            "run": {"accept_config_changes": True},
        }
        with pytest.raises(ValueError, match=r"optim\.state_dtype: fp8"):
            train(
                tiny_run_config(tmp_path, "run", **more),
                model=make_tiny_model(),
                train_source=SyntheticSource(seed=1),
                progress=False,
            )


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "fp8"])
def test_a_step_by_row_slices_is_the_whole_step_bit_for_bit(monkeypatch, state_dtype: str) -> None:
    """A parameter over ``STEP_ELEMENTS`` is updated slice by slice (bounded temporaries): the same bits."""
    from infir2.fp8 import moments

    cfg = parse_config({"optim": {"state_dtype": state_dtype, "grad_dtype": "bf16"}}, "<t>").optim
    runs = []
    for limit in (moments.STEP_ELEMENTS, 1000):  # 1000: 3 rows of 256 a slice, the last one partial
        monkeypatch.setattr(moments, "STEP_ELEMENTS", limit)
        model = _model()
        regression_steps(model, build_optimizer(model, cfg), range(4))
        runs.append(model)
    for a, b in zip(runs[0].parameters(), runs[1].parameters(), strict=True):
        assert torch.equal(a, b)
