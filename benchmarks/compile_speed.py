"""Training-step time of a small converted model, eager vs ``torch.compile`` (inductor), beside the
unconverted model, and how many graphs each compiles into.

Each model is a Qwen2 built from a config (no download) and runs forward + backward of the next-token
loss; the FP8 one is ``blockwise`` inside ``cache_fp8_weights`` as the trainer runs it. Each model is
compiled first (the first step's time, compilation included, is printed separately); then every
variant runs once per round, ``--warmup`` rounds and ``--repeats`` timed ones, so that a shared
CPU's load hits all alike, and the fastest timed step of each is reported. Graph breaks come from dynamo's own
counter.

    python benchmarks/compile_speed.py                       # 2 layers, width 256, 4 x 256 tokens
    python benchmarks/compile_speed.py --device cuda --hidden 1024 --layers 4
"""

from __future__ import annotations

import argparse
import copy
import time
from contextlib import nullcontext

import torch
from torch._dynamo.utils import counters
from transformers import Qwen2Config, Qwen2ForCausalLM

from infir2 import Fp8Linear, convert_to_fp8
from infir2.nn import cache_fp8_weights


def build(hidden: int, layers: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).float().to(device)


def step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with (
        cache_fp8_weights(model) if any(isinstance(m, Fp8Linear) for m in model.modules()) else nullcontext()
    ):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def compile_model(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.nn.Module, float, int, int]:
    """(the compiled copy, its first step's seconds, graphs, graph breaks)."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(copy.deepcopy(model))
    first = step(compiled, ids)  # compiles forward and backward
    return compiled, first, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256, help="model width (a multiple of 64)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--batch", type=int, default=4, help="sequences a step")
    parser.add_argument("--seq", type=int, default=256, help="tokens a sequence")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds after compiling")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (the fastest is reported)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    ids = torch.randint(0, 2048, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    rows = []
    for name in ("unconverted (fp32)", "FP8 blockwise"):
        model = build(args.hidden, args.layers, args.device)
        if name.startswith("FP8"):
            convert_to_fp8(model, "blockwise")
        compiled, first, graphs, breaks = compile_model(model, ids)
        rows.append(
            {
                "name": name,
                "models": (model, compiled),
                "first": first,
                "graphs": graphs,
                "breaks": breaks,
                "eager": float("inf"),
                "compiled": float("inf"),
            }
        )
    for i in range(args.warmup + args.repeats):  # every variant once per round: the same load for all
        for r in rows:
            for kind, model in zip(("eager", "compiled"), r["models"], strict=True):
                seconds = step(model, ids)
                if i >= args.warmup:
                    r[kind] = min(r[kind], seconds)
    print(
        f"{args.layers} layers, width {args.hidden}, {args.batch} x {args.seq} tokens, {args.device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"{'model':36} {'eager ms':>9} {'compiled ms':>12} {'compiled/eager':>15} {'first step s':>13} "
        f"{'graphs':>7} {'breaks':>7}"
    )
    for r in rows:
        print(
            f"{r['name']:36} {r['eager'] * 1e3:9.1f} {r['compiled'] * 1e3:12.1f} "
            f"{r['compiled'] / r['eager']:15.2f} {r['first']:13.1f} {r['graphs']:7d} {r['breaks']:7d}"
        )
    base, fp8 = rows
    print(
        f"FP8 / baseline step time: eager {fp8['eager'] / base['eager']:.2f}, "
        f"compiled {fp8['compiled'] / base['compiled']:.2f}"
    )


if __name__ == "__main__":
    main()
