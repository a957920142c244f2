"""Time FP8 against high precision, side by side in one process: linears, quantizers, a training step.

Three sections (measured by ``infir2.tools.bench.measure``), each printed as rows of one table at the end
(and written as JSON with --json):

1. quantize  - GB/s of each quantization (1x128 activations, 128x1 wgrad tiles, 128x128 weights)
               against a device-to-device copy and a plain cast of the same tensor.
2. linear    - fwd+bwd time of nn.Linear (the baseline dtype) vs Fp8Linear at the Qwen2.5 layer GEMM
               shapes, and the activation bytes each saves for backward (measured with
               ``torch.autograd.graph.saved_tensors_hooks``; parameters and Fp8Linear's per-layer FP8
               weight copy, N*K bytes + scales, excluded: they do not grow with tokens).
3. step      - a full training step (forward, backward, AdamW) of a Qwen2.5-shaped model: step time,
               forward/backward split, peak memory (CUDA), bytes the forward saves for backward (all
               devices; parameters excluded, Fp8Linear's FP8 weight copies included), TFLOP/s.

A ratio is FP8 / baseline: below 1 is better for time and memory, above 1 for GB/s and TFLOP/s.
On a GPU the baseline is BF16 and the FP8 path the "cuda" backend (Triton quantization, cuBLAS
block-scaled GEMMs). On a CPU the FP8 path is emulated (dequantize + fp32 matmul, so it cannot be
faster) and the baseline is fp32, because this CPU class has no native bf16 (bf16 is timed too where
it is cheap); CPU figures show overheads and memory, not the GPU speed-up.

Examples:
  infir2 bench --preset quick                  # CPU, < 1 minute (what CI runs)
  infir2 bench --preset medium --backends emulated,compiled --json bench.json
  infir2 bench --preset full --json gpu.json   # H100/H200: 1.5B + 7B GEMMs at 8k tokens, 1.5B step
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from ...fp8 import RECIPES, get_recipe, recipe_names
from ...kernels import BACKENDS, bind
from ...model import resolve_device
from ..recipe_spec import unique
from .measure import BenchConfig, StepModel, bench_linear, bench_quantize, bench_step, device_name

__all__ = ["PRESETS", "SECTIONS", "add_arguments", "main_table", "run", "run_bench"]


def _cpu_preset(tokens: int, scale: int, step: StepModel) -> BenchConfig:
    """A CPU preset: the 1.5B layer shapes divided by ``scale``, one warm-up and three timed runs."""
    return BenchConfig(tokens=tokens, models=("1.5B",), scale=scale, warmup=1, iters=3, step=step)


PRESETS: dict[str, BenchConfig] = {
    # CPU, well under a minute: 1.5B shapes / 4, 256 tokens, a 2-layer 256-wide model.
    "quick": _cpu_preset(
        tokens=256,
        scale=4,
        step=StepModel(
            hidden=256, intermediate=1536, heads=4, kv_heads=2, head_dim=64, layers=2, vocab=2048, seq=256
        ),
    ),
    # CPU, a few minutes: real 1.5B layer shapes at 1024 tokens, a 4-layer 512-wide model at 512.
    "medium": _cpu_preset(
        tokens=1024,
        scale=1,
        step=StepModel(
            hidden=512, intermediate=2816, heads=4, kv_heads=2, head_dim=128, layers=4, vocab=8192, seq=512
        ),
    ),
    # GPU: the authors' shapes, 8k tokens; the 1.5B model (all 28 layers) at 8k context.
    "full": BenchConfig(),
}

#: the sections, in the order they run
SECTIONS = ("quantize", "linear", "step")


# ----------------------------------------------------------------------------------------------
# driver


def _fp8_backends(requested: str | None, device: torch.device, recipe: str = "blockwise") -> list[str]:
    if requested:
        names = [b.strip() for b in requested.split(",") if b.strip()]
        unique(names, "--backends", "backend")
        for name in names:
            bind(get_recipe(recipe), device, name)  # a clear error for an unusable one
        return names
    return [bind(get_recipe(recipe), device).name]


def _recipes(requested: str) -> list[str]:
    names = recipe_names(requested)
    bad = [r for r in names if not RECIPES[r].enabled]
    if bad:
        fp8 = [r for r in RECIPES if RECIPES[r].enabled]
        raise ValueError(f"--recipes: {bad} is not an FP8 recipe; expected some of {', '.join(fp8)}")
    return names


def run_bench(
    cfg: BenchConfig,
    device: torch.device,
    backends: list[str],
    sections: list[str],
    arms: list[tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """Run the sections; returns ``{"meta": ..., "rows": [...]}``. ``arms`` (recipe, backend) of the
    linear and step sections default to ``blockwise`` on each of ``backends``."""
    base_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    arms = arms or [("blockwise", b) for b in backends]
    rows: list[dict] = []
    if "quantize" in sections:  # the reference beside each backend's (emulated's is the reference itself)
        rows += bench_quantize(
            cfg, device, base_dtype, ["reference", *[b for b in backends if b != "emulated"]]
        )
    if "linear" in sections:
        rows += bench_linear(cfg, device, base_dtype, arms)
    if "step" in sections:
        rows += bench_step(cfg, device, base_dtype, arms)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _triton_version(),
        "backends": backends,
        "recipes": sorted({r for r, _ in arms}),
        "config": asdict(cfg),
    }
    return {"meta": meta, "rows": rows}


def _triton_version() -> str | None:
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    return str(triton.__version__)


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def main_table(result: dict[str, Any]) -> str:
    """The one table: section | case | metric | baseline | value | fp8 | value | fp8/baseline."""
    head = ("section", "case", "metric", "baseline", "value", "fp8 path", "value", "ratio")
    body = [
        (
            r["section"],
            r["case"],
            r["metric"],
            r["baseline"],
            _fmt(r["baseline_value"]),
            r["fp8"],
            _fmt(r["fp8_value"]),
            _fmt(r["ratio"]),
        )
        for r in result["rows"]
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body, strict=True)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    meta = result["meta"]
    title = f"infir2 bench  {meta['date']}  {meta['device']}  torch {meta['torch']}  backends {','.join(meta['backends'])}"
    return "\n".join([title, line(head), line(["-" * w for w in widths]), *(line(r) for r in body)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="sizes: quick (CPU, <1 min), medium (CPU, minutes), full (GPU); "
        "default: full on CUDA, quick on CPU",
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument(
        "--backends",
        default=None,
        help="comma-separated FP8 backends to compare (default: the automatic choice), "
        f"from {', '.join(BACKENDS)}",
    )
    parser.add_argument(
        "--recipes",
        default="blockwise",
        help="comma-separated FP8 recipes of the linear and step sections, each against the "
        f"same baseline (from {', '.join(r for r in RECIPES if RECIPES[r].enabled)})",
    )
    parser.add_argument("--sections", default=",".join(SECTIONS), help="which sections to run")
    parser.add_argument(
        "--tokens", type=int, default=None, help="tokens per linear GEMM (overrides the preset)"
    )
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of the step model")
    parser.add_argument("--seq", type=int, default=None, help="context length of the step model")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (median is reported)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")


def run(args: argparse.Namespace) -> int:
    for flag in (
        "tokens",
        "iters",
        "layers",
        "seq",
    ):  # each overrides the preset; 0 used to mean "the preset's"
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag}: must be >= 1, got {value}")
    device = resolve_device(args.device or "auto")
    cfg = PRESETS[args.preset or ("full" if device.type == "cuda" else "quick")]
    if args.tokens:
        cfg = replace(cfg, tokens=args.tokens)
    if args.iters:
        cfg = replace(cfg, iters=args.iters)
    if cfg.step is not None and (args.layers or args.seq):
        cfg = replace(
            cfg, step=replace(cfg.step, layers=args.layers or cfg.step.layers, seq=args.seq or cfg.step.seq)
        )
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unique(sections, "--sections", "section")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"--sections: unknown {sorted(unknown)}; expected {', '.join(SECTIONS)}")
    recipes = _recipes(args.recipes)
    arms = [(r, b) for r in recipes for b in _fp8_backends(args.backends, device, r)]
    result = run_bench(cfg, device, _fp8_backends(args.backends, device), sections, arms)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print(main_table(result))
    return 0
