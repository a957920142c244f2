"""CPU emulation speed: the reference quantizer + ``emulated`` GEMMs vs ``kernels.fast_emulated``.

Side by side in one process, fastest of ``--repeats`` rounds (the paths are interleaved in every
round, so a busy shared CPU slows them alike):

* **quantize**: reference ``quantize`` + ``dequantize`` (what the emulated GEMM consumes) vs
  ``fast_emulated.quantize`` (data, scale_inv and the dequantized fp32 copy in one call);
* **gemms**: the three GEMMs of one linear step as plain functions (no autograd, no module): fp32
  ``x @ w.T, dy @ w, dy.T @ x`` vs reference quantize + ``emulated`` GEMMs vs fast quantize + GEMMs
  on the kept fp32 operands (the wgrad copy of X is stored as FP8 and decoded, the weight's fp32
  copy is kept from fprop for dgrad);
* **linear**: the same step through autograd: ``nn.Linear`` (fp32) vs ``Fp8Linear`` on the
  ``emulated`` backend vs ``Fp8Linear`` on ``fast_emulated``;
* **model**: forward + backward of the demo's 4-layer Qwen2-style model (``infir2 demo`` sizes),
  fp32 vs blockwise FP8 on each backend;
* **step**: the training loop's step on that model (``prepare_for_training``: the SwiGLU recompute;
  weights quantized once per step by ``cache_fp8_weights``; forward, backward, AdamW).

Run: ``nice python benchmarks/cpu_emulation.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
from torch import nn

from infir2.fp8.quantize import dequantize, quantize
from infir2.fp8.recipe import Cast
from infir2.kernels import Operand, emulated
from infir2.kernels import fast_emulated as fe
from infir2.model import prepare_for_training
from infir2.nn import Fp8Linear, cache_fp8_weights, convert_to_fp8
from infir2.tools.demo import FULL

FAST = "fast_emulated"
TOKENS = FULL.cpt_batch * FULL.seq_len  # tokens per CPT micro-batch of the demo
H, I = FULL.hidden_size, FULL.intermediate_size  # noqa: E741 - the usual name of the MLP width

# (label, tokens, in_features, out_features)
LINEARS = [
    (f"demo q,o {TOKENS}x{H}->{H}", TOKENS, H, H),
    (f"demo gate,up {TOKENS}x{H}->{I}", TOKENS, H, I),
    (f"demo down {TOKENS}x{I}->{H}", TOKENS, I, H),
    (f"demo SFT gate,up {FULL.sft_tokens_per_micro_batch}x{H}->{I}", FULL.sft_tokens_per_micro_batch, H, I),
    ("large 2048x1024->2816", 2048, 1024, 2816),
]


def fastest(fns: dict[str, Callable[[], object]], repeats: int, inner: int) -> dict[str, float]:
    """Milliseconds per call of each function: the fastest of ``repeats`` interleaved rounds."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / inner * 1e3)
    return best


def row(section: str, case: str, times: dict[str, float], baseline: str) -> None:
    base = times[baseline]
    for name, ms in times.items():
        ratio = f"{ms / base:6.2f}x" if name != baseline else "     -"
        print(f"{section:<9} {case:<34} {name:<24} {ms:9.3f} ms  {ratio} vs {baseline}")


def bench_quantize(repeats: int, inner: int) -> None:
    g = torch.Generator().manual_seed(0)
    for label, shape, block in [
        (f"act 1x128 {TOKENS}x{H}", (TOKENS, H), (1, 128)),
        (f"act 128x1 {TOKENS}x{I}", (TOKENS, I), (128, 1)),
        (f"weight 128x128 {I}x{H}", (I, H), (128, 128)),
        ("act 1x128 2048x1024", (2048, 1024), (1, 128)),
        ("act 128x1 2048x2816", (2048, 2816), (128, 1)),
    ]:
        x = torch.randn(shape, generator=g)

        def reference(x: torch.Tensor = x, block: tuple[int, int] = block) -> object:
            data, scale_inv = quantize(x, block)
            return dequantize(data, scale_inv, block)

        times = fastest(
            {
                "reference q+dq": reference,
                "reference q only": lambda x=x, b=block: quantize(x, b),
                FAST: lambda x=x, b=block: fe.quantize_kept(x, b),
            },
            repeats,
            inner,
        )
        row("quantize", label, times, "reference q+dq")


def reference_gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Fp8Linear's three GEMMs on the emulated backend (blockwise recipe blocks)."""

    def q(t: torch.Tensor, block: tuple[int, int]) -> Operand:
        return emulated.quantize(t, Cast(block))

    xq, x_w, wq = q(x, (1, 128)), q(x, (128, 1)), q(w, (128, 128))
    y = emulated.gemm_nt(xq, wq, torch.float32)  # [T,K] @ [K,N] -> [T,N]
    dyq, dy_w = q(dy, (1, 128)), q(dy, (128, 1))
    dx = emulated.gemm_nt(dyq, wq.t(), torch.float32)  # [T,N] @ [N,K] -> [T,K]
    dw = emulated.gemm_nt(dy_w.t(), x_w.t(), torch.float32)  # [N,T] @ [T,K] -> [N,K]
    return y, dx, dw


def fast_gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same with fast_emulated: kept fp32 operands, X saved as FP8 and decoded for wgrad."""
    _, _, xq = fe.quantize_kept(x, (1, 128))
    x_data, x_scale_inv, _ = fe.quantize_kept(x, (128, 1))  # saved for backward: FP8 bytes + scales only
    _, _, wq = fe.quantize_kept(w, (128, 128))
    y = fe.gemm_nt_fp32(xq, wq, torch.float32)  # [T,K] @ [K,N] -> [T,N]
    _, _, dyq = fe.quantize_kept(dy, (1, 128))
    _, _, dy_w = fe.quantize_kept(dy, (128, 1))
    dx = fe.gemm_nt_fp32(dyq, wq.t(), torch.float32)  # [T,N] @ [N,K] -> [T,K]
    x_w = fe.dequantize(x_data, x_scale_inv, (128, 1))
    dw = fe.gemm_nt_fp32(dy_w.t(), x_w.t(), torch.float32)  # [N,T] @ [T,K] -> [N,K]
    return y, dx, dw


def bench_gemms(repeats: int, inner: int, cases: list[tuple[str, int, int, int]]) -> None:
    g = torch.Generator().manual_seed(0)
    for label, t, k, n in cases:
        x, w, dy = (
            torch.randn(t, k, generator=g),
            torch.randn(n, k, generator=g),
            torch.randn(t, n, generator=g),
        )
        assert all(
            torch.equal(a, b) for a, b in zip(reference_gemms(x, w, dy), fast_gemms(x, w, dy), strict=True)
        )
        times = fastest(
            {
                "fp32 3 GEMMs": lambda x=x, w=w, dy=dy: (x @ w.t(), dy @ w, dy.t() @ x),
                "fp8 reference+emulated": lambda x=x, w=w, dy=dy: reference_gemms(x, w, dy),
                "fp8 fast+kept": lambda x=x, w=w, dy=dy: fast_gemms(x, w, dy),
            },
            repeats,
            inner,
        )
        row("gemms", label, times, "fp32 3 GEMMs")


def linear_step(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], object]:
    def step() -> object:
        xi = x.clone().requires_grad_()  # a new tensor each call: no cached quantization of X
        y = layer(xi)
        y.backward(dy)  # dgrad + wgrad
        layer.weight.grad = None
        return xi.grad

    return step


def bench_linear(repeats: int, inner: int, cases: list[tuple[str, int, int, int]]) -> None:
    g = torch.Generator().manual_seed(0)
    for label, t, k, n in cases:
        base = nn.Linear(k, n, bias=False)
        x, dy = torch.randn(t, k, generator=g), torch.randn(t, n, generator=g)
        layers = {
            "fp32 nn.Linear": base,
            "fp8 emulated": Fp8Linear.from_linear(base, backend="emulated"),
            f"fp8 {FAST}": Fp8Linear.from_linear(base, backend=FAST),
        }
        times = fastest({name: linear_step(m, x, dy) for name, m in layers.items()}, repeats, inner)
        row("linear", label, times, "fp32 nn.Linear")


def bench_model(repeats: int, inner: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=FULL.vocab_size,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=FULL.num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * FULL.seq_len,
        tie_word_embeddings=True,
    )
    ids = torch.randint(
        0, FULL.vocab_size, (FULL.cpt_batch, FULL.seq_len), generator=torch.Generator().manual_seed(0)
    )
    models = {"fp32": Qwen2ForCausalLM(cfg).float()}
    for backend in ("emulated", FAST):
        models[f"fp8 {backend}"] = convert_to_fp8(Qwen2ForCausalLM(cfg).float(), "blockwise", backend=backend)

    def step(model: nn.Module) -> Callable[[], object]:
        def run() -> object:
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
            return None

        return run

    times = fastest({name: step(m) for name, m in models.items()}, repeats, inner)
    label = f"demo {FULL.num_layers}L h{H} i{I} {FULL.cpt_batch}x{FULL.seq_len}"
    row("model", label, times, "fp32")

    # the training loop's step: SwiGLU recompute, weights quantized once per step, AdamW
    trained = {"fp32": prepare_for_training(Qwen2ForCausalLM(cfg), "bf16")}
    for backend in ("emulated", FAST):
        trained[f"fp8 {backend}"] = prepare_for_training(Qwen2ForCausalLM(cfg), "blockwise", backend)

    def train_step(model: nn.Module) -> Callable[[], object]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def run() -> object:
            with cache_fp8_weights(model):
                model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return None

        return run

    times = fastest({name: train_step(m) for name, m in trained.items()}, repeats, inner)
    row("step", label, times, "fp32")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds; the fastest counts")
    parser.add_argument("--quick", action="store_true", help="demo sizes only, 2 rounds")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--sections", default="quantize,gemms,linear,model", help="comma-separated subset")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 2 if args.quick else args.repeats
    print(
        f"cpu_emulation  {datetime.now(timezone.utc).isoformat(timespec='seconds')}  "
        f"{platform.processor() or platform.machine()}  torch {torch.__version__}  "
        f"threads {torch.get_num_threads()}  fastest of {repeats}"
    )
    sections = set(args.sections.split(","))
    cases = LINEARS[:-1] if args.quick else LINEARS
    if "quantize" in sections:
        bench_quantize(repeats, inner=5)
    if "gemms" in sections:
        bench_gemms(repeats, inner=3, cases=cases)
    if "linear" in sections:
        bench_linear(repeats, inner=3, cases=cases)
    if "model" in sections:
        bench_model(repeats, inner=2)


if __name__ == "__main__":
    main()
