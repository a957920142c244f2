"""Peak memory and step time of a CPU training run at the Qwen2.5-0.5B width: measured vs ``infir2 plan``.

Each variant trains a few steps in its own subprocess (one high-water mark cannot hide another) on
random tokens: a Qwen2 model of the 0.5B width (hidden 896, intermediate 4864, 14 / 2 heads, vocab
151,936, tied embedding) with ``--layers`` decoder layers, fp32 masters, AdamW (fp32 moments unless
the variant says), the SwiGLU recompute and the chunked loss as ``infir2 train`` runs them on a CPU
(``model.precision: fp32``). It reports the peak RSS above the RSS before the model was built
(``resource.getrusage``), the mean step time after the first step, and the peak that
``infir2 plan --device cpu`` predicts for the same run, side by side:

* ``baseline``   no FP8 (recipe ``bf16``: plain fp32 linears);
* ``fp8``        recipe ``blockwise`` as the library runs it: the weight cache keeps each weight's FP8
                 codes, every GEMM decodes them (``kernels.fast_emulated.quantize``);
* ``fp8-kept``   the same with the weight's dequantized fp32 copy kept all step beside its codes (the
                 CPU emulation before the change; ``fast_emulated.quantize_kept_operand`` for weights):
                 bit-identical losses, 4 more bytes per weight, one decode fewer per GEMM.
* ``base-m8``, ``fp8-m8``  ``baseline``, ``fp8`` with FP8 AdamW moments (``optim.state_dtype: fp8``);
* ``fp8-g16``    ``fp8`` with bf16 gradients (``optim.grad_dtype: bf16``);
* ``base-stack``, ``fp8-stack``  ``baseline``, ``fp8`` with both.

    python benchmarks/cpu_memory_at_size.py                       # 2 layers, seq 1024, 3 steps
    python benchmarks/cpu_memory_at_size.py --layers 4 --seq-len 512 --variants baseline,fp8
    python benchmarks/cpu_memory_at_size.py --mmap-threshold 131072   # glibc: large blocks mmap'd

RSS counts what glibc keeps after a free: with its default dynamic mmap threshold, freed blocks up
to 32 MiB (a decoded weight, a quantizer's temporaries) are reused from the heap and stay resident.
``--mmap-threshold`` sets ``MALLOC_MMAP_THRESHOLD_`` in the children, so that blocks above it are
mapped and unmapped on free and the peak is closer to the tensors' bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from infir2.tools.machine import cpu_description

GIB = 2**30
SHAPE = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
#: variant -> (recipe, optim keys)
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "baseline": ("bf16", {}),
    "fp8": ("blockwise", {}),
    "fp8-kept": ("blockwise", {}),
    "base-m8": ("bf16", {"state_dtype": "fp8"}),
    "fp8-m8": ("blockwise", {"state_dtype": "fp8"}),
    "fp8-g16": ("blockwise", {"grad_dtype": "bf16"}),
    "base-stack": ("bf16", {"state_dtype": "fp8", "grad_dtype": "bf16"}),
    "fp8-stack": ("blockwise", {"state_dtype": "fp8", "grad_dtype": "bf16"}),
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(variant: str, layers: int, seq_len: int, steps: int) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from infir2.harness.guards import clip_grad_norm
    from infir2.harness.optim import build_optimizer
    from infir2.kernels import fast_emulated
    from infir2.kernels.registry import BACKENDS
    from infir2.loss import token_ce_sum
    from infir2.model import prepare_for_training
    from infir2.nn import cache_fp8_weights
    from infir2.train.config import Fp8Config, OptimConfig

    torch.set_num_threads(1)
    if variant == "fp8-kept":  # weights quantized with their fp32 copy, as before
        BACKENDS["fast_emulated"].quantize = fast_emulated.quantize_kept_operand  # type: ignore[method-assign]
    start = rss_bytes()
    config = Qwen2Config(**SHAPE, num_hidden_layers=layers, max_position_embeddings=max(seq_len, 1024))
    torch.manual_seed(0)
    recipe, optim = VARIANTS[variant]
    model = prepare_for_training(Qwen2ForCausalLM(config), recipe)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4, **optim))  # type: ignore[arg-type]
    device = torch.device("cpu")
    times, losses = [], []
    for _ in range(steps):
        ids = torch.randint(0, SHAPE["vocab_size"], (1, seq_len))
        t0 = time.perf_counter()
        with cache_fp8_weights(model, Fp8Config().weight_cache):  # as the train loop: fp8.weight_cache
            loss = token_ce_sum(model, {"input_ids": ids, "labels": ids}, "fp32", device) / seq_len
            loss.backward()
        clip_grad_norm(model, 1.0)  # infir2's: reads bf16 gradients too
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak": peak - start, "step_s": sum(times[1:]) / max(len(times) - 1, 1), "losses": losses}


def planned(variant: str, layers: int, seq_len: int) -> float:
    from infir2.tools.plan import ModelShape, plan

    recipe, optim = VARIANTS[variant]
    config = {**SHAPE, "num_hidden_layers": layers}
    shape = ModelShape.from_config(config, "0.5B width")
    return plan(shape, recipe, gpus=1, seq_len=seq_len, device="cpu", **optim).peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--mmap-threshold", type=int, default=None, help="MALLOC_MMAP_THRESHOLD_ of the children")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.seq_len, args.steps)))
        return
    print(
        f"CPU: {cpu_description()}; 1 thread; hidden 896, intermediate 4864, 14/2 heads, vocab 151936 (tied), "
        f"{args.layers} layers, seq {args.seq_len}, {args.steps} steps, "
        f"MALLOC_MMAP_THRESHOLD_ {args.mmap_threshold or 'glibc default'}"
    )
    env = dict(os.environ)
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    print(f"{'variant':<10}{'peak GiB':>10}{'planned GiB':>13}{'measured/plan':>15}{'step s':>9}  losses")
    results = {}
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--child", variant]
        cmd += ["--layers", str(args.layers), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
        run = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        r = results[variant] = json.loads(run.stdout.strip().splitlines()[-1])
        plan_bytes = planned(variant, args.layers, args.seq_len) if variant != "fp8-kept" else None
        shown = "-" if plan_bytes is None else f"{plan_bytes / GIB:.2f}"
        ratio = "-" if plan_bytes is None else f"{r['peak'] / plan_bytes:.3f}"
        losses = " ".join(f"{x:.6f}" for x in r["losses"])
        print(f"{variant:<10}{r['peak'] / GIB:>10.2f}{shown:>13}{ratio:>15}{r['step_s']:>9.2f}  {losses}")
    if "baseline" in results:
        for variant in (v for v in results if v != "baseline"):
            print(f"{variant} / baseline peak: {results[variant]['peak'] / results['baseline']['peak']:.3f}")


if __name__ == "__main__":
    main()
