"""The planner against the real training step at full Qwen2.5-1.5B / 7B shape, under ``FakeTensorMode``.

``infir2.tools.fake_step`` runs ``train.loop.train_step`` (two steps; the second measured) on fake
tensors with torch's ``MemTracker`` (as torchtitan's ``scripts/estimate/estimation.py`` does): a CPU
step (fp32, no autocast, the FP8 GEMMs emulated by the CPU chain), so the plan it is set against is
``plan(..., device="cpu")``. Per variant and term: the plan, the tracked bytes and plan / tracked.
The terms (``tools.fake_step`` doc): parameters, gradients (the most alive at once), moments,
activations (the most bytes in forward + backward that are none of those), the peak of forward +
backward, of the optimizer step, and of the step. Nothing is allocated: it runs anywhere in minutes.

    PYTHONPATH=src python benchmarks/plan_vs_fake_step.py                       # 1.5B and 7B, 8k
    PYTHONPATH=src python benchmarks/plan_vs_fake_step.py --models qwen2.5-1.5b --variants fp8,fp8-stack
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from infir2.tools.machine import cpu_description

#: variant -> ``StepSettings`` fields (activation checkpointing on unless said)
VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {"recipe": "bf16"},
    "fp8": {},
    "fp8-moments": {"state_dtype": "fp8"},
    "fp8-bf16-grads": {"grad_dtype": "bf16"},
    "fp8-stack": {"state_dtype": "fp8", "grad_dtype": "bf16"},
    "fp8-no-ckpt": {"activation_checkpointing": False},
    "bf16-no-ckpt": {"recipe": "bf16", "activation_checkpointing": False},
    "fp8-2-micro": {"micro_batches": 2},
}
DEFAULT = "bf16,fp8,fp8-stack,fp8-no-ckpt,bf16-no-ckpt"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen2.5-1.5b,qwen2.5-7b")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--variants", default=DEFAULT, help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = p.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)} (expected some of {', '.join(VARIANTS)})")

    import torch

    from infir2.planning import ModelShape
    from infir2.tools.fake_step import StepSettings, compare, fake_step, model_fields

    print(
        f"CPU: {cpu_description()}; torch {torch.__version__}; a CPU step (fp32), planned with device='cpu'"
    )
    print(f"{'model':13} {'variant':15} {'term':14} {'plan GiB':>9} {'tracked GiB':>12} {'plan/tracked':>13}")
    for model in args.models.split(","):
        fields = model_fields(model)
        shape = ModelShape.from_config(fields, model)
        for variant in args.variants.split(","):
            settings = StepSettings(seq_len=args.seq_len, **VARIANTS[variant])
            start = time.perf_counter()
            rows = compare(fake_step(fields, settings), settings.plan(shape))
            for term, (planned, tracked) in rows.items():
                ratio = planned / tracked if tracked else float("nan")
                print(
                    f"{model:13} {variant:15} {term:14} {planned / 2**30:9.2f} {tracked / 2**30:12.2f} {ratio:13.3f}"
                )
            print(f"{model:13} {variant:15} (fake step: {time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
