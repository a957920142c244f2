"""The optimizer step's temporaries, measured: what ``planning.optimizer.optimizer_step_bytes`` plans.

One parameter of the Qwen2.5-0.5B embedding's shape (151,936 x 896, 136M elements) with its gradient, in
its own subprocess per variant: build the optimizer (``optim.state_dtype``, ``optim.grad_dtype``), take
one step (the state is made), then reset the peak RSS (``/proc/self/clear_refs``), take a second step and
report how far the peak rose above the RSS before it. Slices of ``STEP_ELEMENTS`` (16M elements, 64 MiB
in fp32) are mapped and unmapped by glibc on free, so the RSS follows the live tensors. Prints the CPU,
the measured rise, the plan's term and their ratio.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/optimizer_step_memory.py
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

MIB = 2**20
SHAPE = (151936, 896)
VARIANTS = {
    "fp32": {"state_dtype": "fp32"},
    "bf16": {"state_dtype": "bf16"},
    "fp8": {"state_dtype": "fp8"},
    "fp8_expand": {"state_dtype": "fp8", "fp8_range_expansion": True},
    "fp8+bf16_grads": {"state_dtype": "fp8", "grad_dtype": "bf16"},
}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak() -> int:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("VmHWM:")).split()[1]) * 1024


def child(variant: str) -> dict[str, float]:
    import torch
    from torch import nn

    from infir2.harness.grads import GRAD_ATTR
    from infir2.harness.optim import build_optimizer
    from infir2.train.config import OptimConfig

    torch.set_num_threads(1)
    model = nn.Embedding(*SHAPE)
    opt = build_optimizer(model, OptimConfig(lr=1e-4, **VARIANTS[variant]))  # type: ignore[arg-type]

    def grad() -> None:
        g = torch.randn(SHAPE) * 1e-3
        if VARIANTS[variant].get("grad_dtype") == "bf16":
            setattr(model.weight, GRAD_ATTR, g.to(torch.bfloat16))
        else:
            model.weight.grad = g

    grad()
    opt.step()  # the state is made here
    grad()
    before = rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    opt.step()
    return {"rise": peak() - before}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    from infir2.planning import ModelShape, PlanInputs
    from infir2.planning.optimizer import optimizer_step_bytes
    from infir2.tools.machine import cpu_description

    print(f"CPU: {cpu_description()}; one parameter of {SHAPE[0]} x {SHAPE[1]}, 1 thread")
    shape = ModelShape(
        hidden=SHAPE[1], intermediate=SHAPE[1], layers=0, heads=1, kv_heads=1, vocab=SHAPE[0], tied=True
    )
    print(f"{'variant':<16}{'measured MiB':>14}{'planned MiB':>13}{'measured/plan':>15}")
    variants = args.variants.split(",")
    if len(set(variants)) != len(variants) or any(v not in VARIANTS for v in variants):
        p.error(f"--variants: each of {', '.join(VARIANTS)} at most once, got {args.variants}")
    for variant in variants:
        out = subprocess.run(
            [sys.executable, __file__, "--child", variant], capture_output=True, text=True, check=True
        )
        rise = json.loads(out.stdout.strip().splitlines()[-1])["rise"]
        o = VARIANTS[variant]
        inputs = PlanInputs(
            "bf16",
            device="cpu",
            state_dtype=o["state_dtype"],
            grad_dtype=o.get("grad_dtype", "fp32"),
            state_expand=bool(o.get("fp8_range_expansion")),
        )
        plan = optimizer_step_bytes(shape, inputs)
        ratio = f"{rise / plan:.2f}" if plan else "-"
        print(f"{variant:<16}{rise / MIB:>14.0f}{plan / MIB:>13.0f}{ratio:>15}")


if __name__ == "__main__":
    main()
