"""The README's `HighPrecisionEvalTrainer`: the HF `Trainer` on a converted model evaluates in high
precision with it, in FP8 without it (what users got before it was documented)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

pytest.importorskip("accelerate")

README = Path(__file__).parents[1] / "README.md"


def _readme_trainer_class():
    """The class exactly as the README shows it."""
    import infir2

    source = re.search(
        r"```python\n(from transformers import Trainer\n\nclass HighPrecisionEvalTrainer.*?)```",
        README.read_text(),
        re.S,
    )
    assert source, "the README no longer shows HighPrecisionEvalTrainer"
    namespace = {"infir2": infir2}
    exec(source.group(1), namespace)
    return namespace["HighPrecisionEvalTrainer"]


def test_the_documented_trainer_evaluates_in_high_precision(tmp_path):
    from transformers import Trainer, TrainingArguments

    import infir2
    from infir2.nn import fp8_modules

    torch.manual_seed(0)
    model = make_tiny_model("qwen2")
    infir2.convert_to_fp8(model, recipe="blockwise")
    ids = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(str(tmp_path), per_device_eval_batch_size=4, report_to=[], use_cpu=True)
    with torch.no_grad():
        model.eval()
        fp8 = float(model(input_ids=ids, labels=ids).loss)
        with infir2.disable_fp8(model):
            high = float(model(input_ids=ids, labels=ids).loss)
    assert abs(fp8 - high) > 1e-6  # the two are distinguishable
    plain = Trainer(model=model, args=args, eval_dataset=data).evaluate()["eval_loss"]
    documented = _readme_trainer_class()(model=model, args=args, eval_dataset=data).evaluate()["eval_loss"]
    assert plain == pytest.approx(fp8, rel=1e-5)
    assert documented == pytest.approx(high, rel=1e-5)
    assert all(m.fp8_enabled for _, m in fp8_modules(model))  # training goes on in FP8 after evaluation
