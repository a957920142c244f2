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
from train_synthetic import CrashAfter, SyntheticSource, one_thread, tiny_run_config

_one_thread = pytest.fixture(autouse=True)(one_thread)
_DATA = {"vocab_size": 256, "seq_len": 32, "seed": 1}


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_converted_moe_trains_and_resumes_exactly(tmp_path, family):
    kw = {"train": {"max_steps": 8, "save_every": 4, "keep_last": 2}, "optim": {"lr": 1e-2}}
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
