"""optim.state_dtype: LowPrecisionAdamW against torch's AdamW, bf16 moments, state-dict round trip."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from infir2.harness.optim import LowPrecisionAdamW, build_optimizer
from infir2.train.config import parse_config
from train_synthetic import one_thread, regression_steps

_one_thread = pytest.fixture(autouse=True)(one_thread)

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def test_fp32_state_is_torch_adamw() -> None:
    """The same math as torch.optim.AdamW when the moments are kept in fp32 (the update rule itself)."""
    a, b = _model(), _model()
    regression_steps(a, torch.optim.AdamW(a.parameters(), **HYPER, foreach=False), range(5))
    regression_steps(b, LowPrecisionAdamW(b.parameters(), **HYPER, state_dtype=torch.float32), range(5))
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb, pa, rtol=1e-6, atol=1e-7)


def test_bf16_state_stores_bf16_and_tracks_fp32() -> None:
    a, b = _model(), _model()
    regression_steps(a, torch.optim.AdamW(a.parameters(), **HYPER), range(10))
    opt = LowPrecisionAdamW(b.parameters(), **HYPER)
    regression_steps(b, opt, range(10))
    for p in b.parameters():
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        assert opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16
        assert p.dtype == torch.float32
    for p0, pa, pb in zip(_model().parameters(), a.parameters(), b.parameters(), strict=True):
        # the bf16 rounding of the moments changes the 10 updates' sum by a few percent, and is really there
        moved = (pa - p0).norm()
        assert 0 < (pa - pb).norm() < 0.05 * moved


def test_state_dict_round_trip_resumes_exactly() -> None:
    """3 steps, save, load into a fresh model + optimizer, 3 more == 6 steps in one go (bit-exact)."""
    ref = _model()
    opt_ref = LowPrecisionAdamW(ref.parameters(), **HYPER)
    regression_steps(ref, opt_ref, range(6))
    first = _model()
    opt = LowPrecisionAdamW(first.parameters(), **HYPER)
    regression_steps(first, opt, range(3))
    saved_model, saved_opt = copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = _model(seed=1)
    resumed.load_state_dict(saved_model)
    opt2 = LowPrecisionAdamW(resumed.parameters(), **HYPER)
    opt2.load_state_dict(saved_opt)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt2.state.values())
    regression_steps(resumed, opt2, range(3, 6))
    for pa, pb in zip(ref.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize(("state_dtype", "bytes_per_param"), [("fp32", 16), ("bf16", 12)])
def test_bytes_per_parameter(state_dtype: str, bytes_per_param: int) -> None:
    """fp32 master + fp32 grad + two moments: 16 bytes (fp32 moments) or 12 (bf16), counted from tensors."""
    cfg = parse_config({"optim": {"state_dtype": state_dtype}}, "<test>")
    model = _model()
    opt = build_optimizer(model, cfg.optim)
    regression_steps(model, opt, range(1))
    n = sum(p.numel() for p in model.parameters())
    params_and_grads = sum(
        p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size() for p in model.parameters()
    )
    moments = sum(
        t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step"
    )
    assert (params_and_grads + moments) / n == bytes_per_param


def test_config_rejects_unknown_state_dtype() -> None:
    with pytest.raises(ValueError, match=r"optim\.state_dtype"):
        parse_config({"optim": {"state_dtype": "fp16"}}, "<test>")


@pytest.mark.slow
def test_training_resume_with_bf16_moments_is_exact(tmp_path) -> None:
    """Through the loop and checkpoint.py: 4 steps == 2, a crash, a resume; moments saved in bf16."""
    from conftest import make_tiny_model
    from infir2.checkpoint import load_checkpoint
    from infir2.train import train
    from train_synthetic import CrashAfter, SyntheticSource, tiny_run_config

    kw = {"train": {"max_steps": 4, "save_every": 2}, "optim": {"lr": 3e-3, "state_dtype": "bf16"}}
    full = train(
        tiny_run_config(tmp_path, "full", **kw),
        model=make_tiny_model(hidden=64),
        train_source=SyntheticSource(seed=1),
        progress=False,
    )
    cfg = tiny_run_config(tmp_path, "split", **kw)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, model=make_tiny_model(hidden=64), train_source=CrashAfter(2, seed=1), progress=False)
    resumed = train(
        cfg, model=make_tiny_model(hidden=64, seed=5), train_source=SyntheticSource(seed=1), progress=False
    )
    assert [m["loss"] for m in resumed.history] == [m["loss"] for m in full.history[2:]]
    moments = [
        t
        for s in load_checkpoint(resumed.checkpoint)["optimizer"]["state"].values()
        for k, t in s.items()
        if k.startswith("exp_avg")
    ]
    assert moments and all(t.dtype == torch.bfloat16 for t in moments)
