"""AdamW moments in fp32, bf16 and FP8 (``optim.state_dtype``, ``optim.fp8_*``) and bf16 gradients
(``optim.grad_dtype``): does the cheaper storage train as well? Two legs, each a paired comparison by
seed against fp32 moments and gradients (``tools.paired``'s rule):

* ``--leg text`` (the demo's real-text leg): the King James Bible, width 256, 4 layers, 64 steps at lr
  1e-3, FP8 blockwise GEMMs, held-out loss per seed (``infir2 demo``'s settings; ``infir2 fidelity``'s
  runs), margin +-1% as in the demo;
* ``--leg long`` (a long run): the same corpus and model family at width 128 for ``--steps`` steps
  (default 500) at lr 1e-3, FP8 blockwise GEMMs, held-out loss per seed, margin +-1%.

Variants: ``fp32`` (the baseline), ``bf16``, ``fp8`` (E4M3 m, sqrt(v) in E4M3, block 128), ``fp8_e5m2``
(v in E5M2), ``fp8_expand`` (COAT's range expansion), ``bf16_grads`` (``optim.grad_dtype: bf16``, fp32
moments), ``fp8_bf16_grads`` (both); and one that is not an optimizer's, ``mlp_fp8`` (fp32 moments, the
SwiGLU's saved gate and up outputs in FP8: ``model.mlp_saved_fp8``); ``--variants`` picks. Prints the
CPU, every run and the verdicts.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/optim_state_dtype.py --leg text --seeds 0,1,2
    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/optim_state_dtype.py --leg long --steps 500
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from infir2.tools.machine import cpu_description
from infir2.tools.paired import gap_pct, paired_verdict

VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"state_dtype": "fp32"},
    "bf16": {"state_dtype": "bf16"},
    "fp8": {"state_dtype": "fp8"},
    "fp8_e5m2": {"state_dtype": "fp8", "fp8_second_moment": "e5m2"},
    "fp8_expand": {"state_dtype": "fp8", "fp8_range_expansion": True},
    "bf16_grads": {"grad_dtype": "bf16"},
    "fp8_bf16_grads": {"state_dtype": "fp8", "grad_dtype": "bf16"},
}
#: variants that change model keys instead (fp32 moments)
MODEL_VARIANTS: dict[str, dict[str, Any]] = {"mlp_fp8": {"mlp_saved_fp8": True}}
MARGIN = 1.0  # % of the loss


def text_leg(variant: str, seed: int, out: Path, steps: int | None = None) -> float:
    """The demo's real-text run of FP8 blockwise with these moments (``steps``: a long run of width 128
    instead): its held-out loss."""
    from infir2.tools.bench.fidelity import prepare, run_one
    from infir2.tools.demo.results import FULL
    from infir2.tools.demo.text import text_settings

    ts = replace(
        text_settings(FULL, ["blockwise"]),
        optim=tuple(VARIANTS.get(variant, {}).items()),
        model=tuple(MODEL_VARIANTS.get(variant, {}).items()),
    )
    if steps is not None:
        ts = replace(ts, widths=(128,), steps=steps, eval_every=0)
    folder = out / variant
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer, _ = prepare(folder, ts)
    return run_one(folder, ts, ts.widths[0], "blockwise", seed, tokenizer).val_loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--leg", choices=("text", "long"), required=True)
    p.add_argument("--steps", type=int, default=500, help="--leg long: optimizer steps per run")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--variants", default="fp32,fp8,fp8_e5m2,fp8_expand", help="fp32 first (the baseline)")
    args = p.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    if len(set(variants)) != len(variants):
        p.error(f"--variants names a variant twice: {args.variants}")
    if len(set(seeds)) != len(seeds):
        p.error(f"--seeds names a seed twice: {args.seeds}")
    if variants[0] != "fp32" or any(v not in VARIANTS | MODEL_VARIANTS for v in variants):
        p.error(f"--variants: fp32 first, then any of {', '.join(VARIANTS | MODEL_VARIANTS)}")
    print(f"CPU: {cpu_description()}; torch {torch.__version__}")
    loss: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for v in variants:
                loss[v, seed] = text_leg(v, seed, Path(tmp), args.steps if args.leg == "long" else None)
                print(f"  {v:<11} seed {seed}: {loss[v, seed]:.4f}", flush=True)
    what = "held-out loss" if args.leg == "text" else f"held-out loss after {args.steps} steps at width 128"
    print(f"{args.leg} leg, {what}, paired gap to fp32 moments in % (95% t-interval), margin +-{MARGIN}%:")
    for v in variants[1:]:
        gaps = [gap_pct(loss[v, s], loss["fp32", s]) for s in seeds]
        verdict = paired_verdict(gaps, MARGIN, higher_is_better=False)
        print(
            f"  {v:<11} gaps {' / '.join(f'{g:+.2f}' for g in gaps)}: mean {verdict.mean:+.2f} "
            f"[{verdict.low:+.2f}, {verdict.high:+.2f}] n={verdict.n}: {verdict.label}"
        )


if __name__ == "__main__":
    main()
