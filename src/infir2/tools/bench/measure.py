"""What ``infir2 bench`` measures: quantization GB/s, FP8 vs baseline linears, a training step.

Each section returns rows ``{section, case, metric, baseline, baseline_value, fp8, fp8_value, ratio}``
(``ratio`` = FP8 / baseline); the presets, the CLI and the table are ``command.py``'s.

1. ``bench_quantize`` - GB/s of each quantization (1x128 activations, 128x1 wgrad tiles, 128x128
   weights) against a device-to-device copy and a plain cast of the same tensor.
2. ``bench_linear``   - fwd+bwd time of nn.Linear (the baseline dtype) vs Fp8Linear at the Qwen2.5
   layer GEMM shapes, and the activation bytes each saves for backward (``saved_bytes``: measured with
   ``torch.autograd.graph.saved_tensors_hooks``; parameters and Fp8Linear's per-layer FP8 weight copy,
   N*K bytes + scales, excluded: they do not grow with tokens).
3. ``bench_step``     - a full training step (forward, backward, AdamW) of a Qwen2.5-shaped model
   (built by ``model.build_from_config``): step time, forward/backward split, peak memory (CUDA),
   bytes the forward saves for backward (parameters excluded, Fp8Linear's FP8 weight copies
   included), TFLOP/s (``step_flops``).

Timing (``_time_ms``): the median on CUDA (synchronized), the minimum on a CPU, where other jobs only
ever add time.
"""

from __future__ import annotations

import copy
import functools
import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from ...fp8 import get_recipe
from ...fp8.quantize import quantize as reference_quantize
from ...fp8.recipe import Cast
from ...kernels import bind
from ...model import build_from_config
from ...nn import Fp8Linear, convert_to_fp8

__all__ = [
    "QWEN25_LAYERS",
    "BenchConfig",
    "StepModel",
    "bench_linear",
    "bench_quantize",
    "bench_step",
    "device_name",
    "saved_bytes",
    "step_flops",
    "step_model_config",
]

#: (model, projection, in_features K, out_features N, GEMMs of this shape per decoder layer)
QWEN25_LAYERS: dict[str, list[tuple[str, int, int, int]]] = {
    "1.5B": [
        ("q,o", 1536, 1536, 2),
        ("k,v", 1536, 256, 2),
        ("gate,up", 1536, 8960, 2),
        ("down", 8960, 1536, 1),
    ],
    "7B": [
        ("q,o", 3584, 3584, 2),
        ("k,v", 3584, 512, 2),
        ("gate,up", 3584, 18944, 2),
        ("down", 18944, 3584, 1),
    ],
}


_CPU_BF16_MAX_MACS = 5e8  # time nn.Linear in bf16 on a CPU only up to this GEMM size


@dataclass(frozen=True)
class StepModel:
    """A Qwen2-architecture model for the training-step section (the defaults: Qwen2.5-1.5B); the
    comments name the Hugging Face config key of each field (``step_model_config``)."""

    hidden: int = 1536  # hidden_size
    intermediate: int = 8960  # intermediate_size
    heads: int = 12  # num_attention_heads
    kv_heads: int = 2  # num_key_value_heads
    head_dim: int = 128  # hidden = heads x head_dim
    layers: int = 28  # num_hidden_layers
    vocab: int = 151936  # vocab_size
    seq: int = 8192  # tokens of the one sequence a step trains on


@dataclass(frozen=True)
class BenchConfig:
    """What ``run_bench`` measures. ``scale`` divides the layer shapes (CPU presets)."""

    tokens: int = 8192
    models: tuple[str, ...] = ("1.5B", "7B")
    scale: int = 1
    step: StepModel | None = field(default_factory=StepModel)
    warmup: int = 3
    iters: int = 10
    time_bf16_on_cpu: bool = True

    def layer_shapes(self) -> list[tuple[str, str, int, int, int]]:
        return [
            (model, name, k // self.scale, n // self.scale, count)
            for model in self.models
            for name, k, n, count in QWEN25_LAYERS[model]
        ]


# ----------------------------------------------------------------------------------------------
# timing and memory helpers


def device_name(device: torch.device) -> str:
    """What a measurement ran on: the GPU's name, or the CPU's processor name ("cpu" where it has none)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    """Wall time of ``fn`` in ms: the median on CUDA (synchronized), the minimum on a CPU."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(max(iters, 1)):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    # On a shared CPU other jobs only ever add time: the fastest run is the best estimate. On a GPU
    # (synchronized, not shared) the median is the usual figure.
    return times[0] if device.type == "cpu" else times[len(times) // 2]


def saved_bytes(fn: Callable[[], Any], exclude: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct tensors autograd saves for backward while ``fn`` runs (``exclude``: params)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _ratio(fp8: float | None, base: float | None) -> float | None:
    if fp8 is None or base is None or base == 0:
        return None
    return fp8 / base


def _row(
    section: str, case: str, metric: str, base_name: str, base: float | None, fp8_name: str, fp8: float | None
) -> dict[str, Any]:
    return {
        "section": section,
        "case": case,
        "metric": metric,
        "baseline": base_name,
        "baseline_value": base,
        "fp8": fp8_name,
        "fp8_value": fp8,
        "ratio": _ratio(fp8, base),
    }


# ----------------------------------------------------------------------------------------------
# 1. quantization throughput


def bench_quantize(
    cfg: BenchConfig, device: torch.device, dtype: torch.dtype, backends: list[str]
) -> list[dict]:
    """GB/s of each quantization vs a copy and a plain cast of the same tensor."""
    model = cfg.models[0]
    hidden = QWEN25_LAYERS[model][0][1] // cfg.scale
    inter = QWEN25_LAYERS[model][2][2] // cfg.scale
    cases = [
        ("act 1x128", (cfg.tokens, hidden), (1, 128)),
        ("act 128x1", (cfg.tokens, hidden), (128, 1)),
        ("weight 128x128", (inter, hidden), (128, 128)),
    ]
    rows = []
    for name, shape, block in tqdm(cases, desc="quantize", leave=False):
        x = torch.randn(shape, device=device, dtype=dtype)
        n = x.numel()
        blocks = math.ceil(shape[0] / block[0]) * math.ceil(shape[1] / block[1])
        moved = {"copy": 2 * n * x.element_size(), "cast": n * x.element_size() + n}
        quant_bytes = n * x.element_size() + n + 4 * blocks
        t_copy = _time_ms(lambda: x.clone(), device, cfg.warmup, cfg.iters)  # noqa: B023
        t_cast = _time_ms(lambda: x.to(torch.float8_e4m3fn), device, cfg.warmup, cfg.iters)  # noqa: B023
        gbs = {"copy": moved["copy"] / t_copy / 1e6, "cast": moved["cast"] / t_cast / 1e6}
        case = f"{name} {shape[0]}x{shape[1]} {str(dtype).replace('torch.', '')}"
        rows.append(_row("quantize", case, "GB/s", "copy", gbs["copy"], "cast", gbs["cast"]))
        for backend in backends:
            quant: Callable[[], object]
            if backend == "reference":
                quant = functools.partial(reference_quantize, x, block, "e4m3", "pow2")
            else:
                quant = functools.partial(
                    bind(get_recipe("blockwise"), device, backend).quantize, x, Cast(block)
                )
            t_q = _time_ms(quant, device, cfg.warmup, cfg.iters)
            rows.append(
                _row(
                    "quantize",
                    case,
                    "GB/s",
                    "copy",
                    gbs["copy"],
                    f"quantize[{backend}]",
                    quant_bytes / t_q / 1e6,
                )
            )
            if block == (1, 128) and backend != "reference":  # both activation copies from one read
                kernels = bind(get_recipe("blockwise"), device, backend)
                both = functools.partial(kernels.quantize_pair, x, Cast((1, 128)), Cast((128, 1)))
                t_b = _time_ms(both, device, cfg.warmup, cfg.iters)
                both_bytes = n * x.element_size() + 2 * n + 4 * (2 * blocks)
                rows.append(
                    _row(
                        "quantize",
                        case.replace("1x128", "1x128+128x1"),
                        "GB/s",
                        "copy",
                        gbs["copy"],
                        f"quantize_both[{backend}]",
                        both_bytes / t_b / 1e6,
                    )
                )
    return rows


# ----------------------------------------------------------------------------------------------
# 2. linear layers


def _linear_step(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        x.grad = None
        layer.weight.grad = None
        layer(x).backward(dy)

    return step


#: An FP8 arm of the linear and step sections: (recipe, backend).
Arm = tuple[str, str]


def _label(arm: Arm) -> str:
    """``backend`` for the default recipe, ``recipe/backend`` for the others."""
    recipe, backend = arm
    return backend if recipe == "blockwise" else f"{recipe}/{backend}"


def bench_linear(
    cfg: BenchConfig, device: torch.device, base_dtype: torch.dtype, fp8_arms: list[Arm]
) -> list[dict]:
    """fwd+bwd of nn.Linear (``base_dtype``, and bf16 on CPU) vs Fp8Linear per layer shape; saved bytes."""
    rows: list[dict] = []
    totals: dict[str, dict[str, float]] = {}
    timed: dict[str, dict[str, int]] = {}  # model -> arm -> shapes timed
    base_name = str(base_dtype).replace("torch.", "")
    for model, name, k, n, count in tqdm(cfg.layer_shapes(), desc="linear", leave=False):
        case = f"{model} {name} {cfg.tokens}x{k}->{n}"
        torch.manual_seed(0)
        base = nn.Linear(k, n, bias=False, device=device, dtype=base_dtype)
        x = torch.randn(cfg.tokens, k, device=device, dtype=base_dtype, requires_grad=True)
        dy = torch.randn(cfg.tokens, n, device=device, dtype=base_dtype)
        t_base = _time_ms(_linear_step(base, x, dy), device, cfg.warmup, cfg.iters)
        b_base = saved_bytes(lambda: base(x), [base.weight])  # noqa: B023
        tot = totals.setdefault(model, {})
        tot[base_name] = tot.get(base_name, 0.0) + count * t_base
        arms = timed.setdefault(model, {})
        cheap = cfg.tokens * k * n <= _CPU_BF16_MAX_MACS  # CPU bf16 GEMMs run 7-300x slower than fp32
        if device.type == "cpu" and base_dtype != torch.bfloat16 and cfg.time_bf16_on_cpu and cheap:
            bf = copy.deepcopy(base).bfloat16()
            xb, dyb = x.detach().bfloat16().requires_grad_(), dy.bfloat16()
            t_bf = _time_ms(_linear_step(bf, xb, dyb), device, 0, 1)
            rows.append(_row("linear", case, "fwd+bwd ms", base_name, t_base, "nn.Linear bf16", t_bf))
            tot["bf16"] = tot.get("bf16", 0.0) + count * t_bf
            arms["bf16"] = arms.get("bf16", 0) + 1
        for recipe, backend in fp8_arms:
            arm = _label((recipe, backend))
            fp8 = Fp8Linear.from_linear(base, recipe, backend=backend)
            t_fp8 = _time_ms(_linear_step(fp8, x, dy), device, cfg.warmup, cfg.iters)
            fp8.set_weight_cache(
                True
            )  # the FP8 weight copy is per layer, not per token: count activations only
            wq = fp8.quantized_weight()
            b_fp8 = saved_bytes(lambda: fp8(x), [base.weight, wq.data, wq.scale_inv])  # noqa: B023
            fp8.set_weight_cache(False)
            rows.append(_row("linear", case, "fwd+bwd ms", base_name, t_base, f"Fp8Linear[{arm}]", t_fp8))
            rows.append(
                _row(
                    "linear",
                    case,
                    "saved act. MB",
                    base_name,
                    b_base / 2**20,
                    f"Fp8Linear[{arm}]",
                    b_fp8 / 2**20,
                )
            )
            tot[arm] = tot.get(arm, 0.0) + count * t_fp8
            arms[arm] = arms.get(arm, 0) + 1
    for model, tot in totals.items():  # one decoder layer's seven projections
        shapes = sum(1 for m, *_ in cfg.layer_shapes() if m == model)
        for arm, t in tot.items():
            if arm != base_name and timed[model].get(arm, 0) == shapes:  # only arms timed on every shape
                label = "nn.Linear bf16" if arm == "bf16" else f"Fp8Linear[{arm}]"
                rows.append(
                    _row(
                        "linear",
                        f"{model} 7 projections of a layer",
                        "fwd+bwd ms",
                        base_name,
                        tot[base_name],
                        label,
                        t,
                    )
                )
    return rows


# ----------------------------------------------------------------------------------------------
# 3. a training step


def step_model_config(spec: StepModel) -> dict[str, Any]:
    """``spec`` as a ``model.build_from_config`` dict: a Qwen2 causal LM, SDPA attention, no KV cache."""
    if spec.hidden != spec.heads * spec.head_dim:
        raise ValueError(f"step model: hidden {spec.hidden} != heads {spec.heads} x head_dim {spec.head_dim}")
    return {
        "arch": "qwen2",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "num_hidden_layers": spec.layers,
        "vocab_size": spec.vocab,
        "max_position_embeddings": max(spec.seq, 128),
        "tie_word_embeddings": False,
        "use_cache": False,
        "attn_implementation": "sdpa",
    }


def step_flops(spec: StepModel, tokens: int) -> float:
    """FLOPs of one training step: 6 x tokens x matmul params, plus causal attention (6 S^2 d per layer)."""
    attn = spec.hidden * spec.heads * spec.head_dim * 2 + spec.hidden * spec.kv_heads * spec.head_dim * 2
    mlp = 3 * spec.hidden * spec.intermediate
    matmul_params = spec.layers * (attn + mlp) + spec.hidden * spec.vocab
    attention = spec.layers * 6 * spec.seq * spec.seq * spec.heads * spec.head_dim * (tokens // spec.seq)
    return 6.0 * tokens * matmul_params + attention


def _train_step_times(
    model: nn.Module, ids: torch.Tensor, opt: torch.optim.Optimizer, device: torch.device
) -> tuple[float, float, float]:
    _sync(device)
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    _sync(device)
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    t3 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3


def bench_step(cfg: BenchConfig, device: torch.device, dtype: torch.dtype, arms: list[Arm]) -> list[dict]:
    """Forward / backward / AdamW of the step model, baseline vs each FP8 arm, run one after another."""
    spec = cfg.step
    if spec is None:
        return []
    ids = torch.randint(0, spec.vocab, (1, spec.seq), device=device)
    results: dict[str, dict[str, float | None]] = {}
    base_name = str(dtype).replace("torch.", "")
    fp8_arms = {_label(arm): arm for arm in arms}
    for arm in tqdm([base_name, *fp8_arms], desc="step", leave=False):
        model = build_from_config(step_model_config(spec), seed=0, device=device).to(dtype=dtype).train()
        if arm != base_name:
            convert_to_fp8(model, fp8_arms[arm][0], backend=fp8_arms[arm][1])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        times = [
            _train_step_times(model, ids, opt, device) for _ in range(cfg.warmup + max(cfg.iters // 2, 1))
        ]
        timed = sorted(times[cfg.warmup :], key=sum)
        measured = timed[0] if device.type == "cpu" else timed[len(timed) // 2]  # see _time_ms
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        params = list(model.parameters())  # read the peak first: this extra forward is not part of a step
        saved = saved_bytes(functools.partial(model, input_ids=ids, labels=ids), params) / 2**30
        total = sum(measured)
        results[arm] = {
            "step ms": total,
            "forward ms": measured[0],
            "backward ms": measured[1],
            "optimizer ms": measured[2],
            "peak GiB": peak,
            "saved for bwd GiB": saved,
            "TFLOP/s": step_flops(spec, spec.seq) / (total * 1e-3) / 1e12,
        }
        del model, opt
    case = f"{spec.layers}-layer h{spec.hidden} seq {spec.seq}"
    rows = []
    for arm in fp8_arms:
        for metric, value in results[arm].items():
            rows.append(
                _row("step", case, metric, base_name, results[base_name][metric], f"fp8[{arm}]", value)
            )
    return rows
