"""Bytes one decoder layer keeps for backward, tensor by tensor: BF16 autocast vs each FP8 recipe.

``infir2 memory`` builds ONE Qwen2 decoder layer with transformers' own classes (no download) at the
real Qwen2.5-1.5B / 7B shapes, runs its forward on ``tokens`` tokens, and walks the autograd graph:
every tensor a backward node holds (``node._saved_*`` attributes, ``saved_tensors`` of custom
Functions such as ``Fp8Linear``'s) is listed once per storage (two views of one buffer cost once),
with the node that keeps it, the module whose output it is, its shape, dtype and bytes.

What counts as the layer's activation memory: tensors with the token dimension. Left out, and listed
apart: parameters and their per-step copies (the bf16 casts autocast makes, ``Fp8Linear``'s quantized
weights -- they do not grow with tokens), and the rotary ``cos``/``sin`` (made once per model forward
and shared by all layers). The layer's input (the residual stream) is counted: the first RMSNorm keeps
it, and nothing else in the model does.

The baseline is what users run today: the Hugging Face layer under ``torch.autocast(bfloat16)`` with
fp32 master weights. An FP8 recipe swaps the seven projections for ``Fp8Linear`` (``convert_to_fp8``)
and runs under the same autocast. That is a GPU run (``--device cuda``, the default, measured on the
CPU with the same tensors); ``--device cpu`` models a CPU run instead: fp32 throughout, no autocast
(``model.precision: fp32``), so the baseline keeps fp32 activations and no weight copies. The SDPA kernel keeps ``q``, ``k``, ``v``, its output and a
per-row logsumexp (no ``[T, T]`` matrix), so every saved tensor is linear in tokens: the figures at a
CPU-sized token count scale linearly to 8k or 32k (``per_token`` is what ``infir2 plan`` uses).
Only the forward runs (saved tensors are made there), but bf16 GEMMs are slow on CPUs without native
bf16: keep ``--tokens`` small (256-1024).

FP8 layers are measured as training runs them, with the two recomputes on by default ("rc mlp,norm"):
the SwiGLU recompute (``model.recompute_mlp``), which keeps the gate and up outputs and recomputes
``silu`` in backward, so the down projection's FP8 input is the only copy of the product; and the
RMSNorm recompute (``model.recompute_norm``), which keeps each norm's input and per-row rstd and makes
the normalized output again in backward, so the next projection's FP8 input is its only copy. Both
are exact. Two baselines are printed: the plain HF layer (what users run today: "vs bf16") and the
same layer with the same recomputes ("vs bf16+rc", like for like, since they are not FP8's own doing).

    infir2 memory                              # 1.5B and 7B shapes, 384 tokens, all recipes
    infir2 memory --models 1.5B --tokens 1024 --recipes blockwise --table
"""

from __future__ import annotations

import argparse

import torch

from ..fp8 import RECIPES
from ..planning.measure import (
    DEVICES,
    LAYER_SHAPES,
    LayerMemory,
    SavedTensor,
    build_layer,
    layer_memory,
    safe_tokens,
    saved_in_graph,
)
from .recipe_spec import unique

__all__ = [
    "DEVICES",
    "LAYER_SHAPES",
    "LayerMemory",
    "SavedTensor",
    "add_arguments",
    "add_run_arguments",
    "build_layer",
    "context_kv_bytes",
    "layer_memory",
    "run",
    "safe_tokens",
    "saved_in_graph",
]


def context_kv_bytes(model: str, tokens: int, context: int, device: str = "cuda") -> int:
    """Bytes one layer's attention keeps beyond one process's under context parallelism with ``tokens``
    per rank: measured on the context attention (``nn.context_parallel.shard_attention``) with the keys and
    values of ``context * tokens`` tokens against the same attention over ``tokens`` (bf16 for a GPU run,
    fp32 for a CPU run)."""
    from ..nn.context_parallel import SequenceShard, shard_attention

    shape = LAYER_SHAPES[model]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    dim = shape.get("head_dim", shape["hidden_size"] // heads)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def kept(degree: int) -> int:
        length = degree * tokens
        q = torch.randn(1, heads, tokens, dim, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, kv_heads, length, dim, dtype=dtype, requires_grad=True) for _ in range(2))
        shard = SequenceShard(torch.zeros(1, length, dtype=torch.long), length - tokens, tokens)
        out = shard_attention(q, k, v, shard, dim**-0.5)
        return sum(t.untyped_storage().nbytes() for _, t in saved_in_graph(out.grad_fn))

    return kept(context) - kept(1)


def format_table(m: LayerMemory) -> str:
    rows = [f"  {'kept by (node.attr)':<44}{'made by':<26}{'shape':<22}{'dtype':<14}{'MiB':>9}  kind"]
    for t in sorted(m.tensors, key=lambda t: (t.kind, -t.bytes)):
        rows.append(
            f"  {t.kept_by[:43]:<44}{t.made_by[:25]:<26}{list(t.shape)!s:<22}{t.dtype:<14}"
            f"{t.bytes / 2**20:>9.2f}  {t.kind}"
        )
    return "\n".join(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="1.5B,7B", help=f"layer shapes: {', '.join(LAYER_SHAPES)}")
    parser.add_argument(
        "--tokens", type=int, default=384, help="tokens per forward (bf16 CPU GEMMs are slow)"
    )
    parser.add_argument(
        "--recipes",
        default=",".join(r for r in RECIPES if r != "bf16"),
        help="FP8 recipes to compare with the bf16 baseline",
    )
    parser.add_argument("--table", action="store_true", help="print every saved tensor, per recipe")
    parser.add_argument(
        "--context",
        type=int,
        default=1,
        help="context parallelism: --tokens per rank, and what attention keeps of the other ranks' keys",
    )
    add_run_arguments(
        parser,
        device_help="the run modelled: cuda (bf16 autocast, default) or cpu (fp32, no autocast)",
        recompute_help=(
            "layers without the SwiGLU recompute training uses by default (model.recompute_mlp: true)"
        ),
        norm_help="layers without the RMSNorm recompute training uses by default (model.recompute_norm: true)",
    )


def add_run_arguments(
    parser: argparse.ArgumentParser, device_help: str, recompute_help: str, norm_help: str
) -> None:
    """``--device`` (cuda / cpu), ``--no-recompute-mlp``, ``--no-recompute-norm`` and ``--mlp-saved-fp8``:
    the run that ``infir2 memory`` and ``infir2 plan`` model."""
    parser.add_argument("--device", choices=DEVICES, default="cuda", help=device_help)
    parser.add_argument("--no-recompute-mlp", action="store_true", help=recompute_help)
    parser.add_argument("--no-recompute-norm", action="store_true", help=norm_help)
    parser.add_argument(
        "--mlp-saved-fp8",
        action="store_true",
        help="the SwiGLU recompute keeps its gate and up outputs in FP8 (model.mlp_saved_fp8; lossy, off by default)",
    )


def run(args: argparse.Namespace) -> int:
    if args.tokens < 1:
        raise ValueError(f"--tokens: must be >= 1, got {args.tokens}")
    if args.context < 1:
        raise ValueError(f"--context: must be >= 1, got {args.context}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unique(models, "--models", "model")  # a row printed twice reads as two measurements
    unique(recipes, "--recipes", "recipe")
    for bad, known, what in (
        (set(models) - set(LAYER_SHAPES), LAYER_SHAPES, "--models"),
        (set(recipes) - set(RECIPES), RECIPES, "--recipes"),
    ):
        if bad:
            raise ValueError(f"{what}: unknown {sorted(bad)}; known: {', '.join(known)}")
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    how = "bf16 autocast (a GPU run)" if args.device == "cuda" else "fp32, no autocast (a CPU run)"
    print(f"saved for backward by ONE decoder layer, {args.tokens} tokens, {how}; MiB (per-token bytes)")
    print(
        f"{'model':<7}{'recipe':<26}{'activations':>12}{'B/token':>10}{'vs bf16':>9}{'vs bf16+rc':>11}"
        f"{'weight copies':>15}{'shared':>9}"
    )
    mlp, norm, fp8 = not args.no_recompute_mlp, not args.no_recompute_norm, args.mlp_saved_fp8
    if fp8 and not mlp:
        raise ValueError(
            "--mlp-saved-fp8: keeps the SwiGLU recompute's inputs in FP8; drop --no-recompute-mlp"
        )
    rc = ",".join(name for name, on in (("mlp", mlp), ("norm", norm)) if on)
    if rc:
        print(f"rc {rc}: the recomputes training runs by default (model.recompute_mlp, model.recompute_norm)")
    if fp8:
        print(
            "mlp-fp8: the SwiGLU recompute keeps its inputs in FP8 (model.mlp_saved_fp8, lossy, off by default)"
        )
        rc += " + mlp-fp8"
    for model in models:
        # the baseline users run (plain HF layer) and the like-for-like one (the same recomputes)
        base = layer_memory(model, "bf16", args.tokens, device=args.device)
        base_rc = layer_memory(model, "bf16", args.tokens, mlp, args.device, norm, fp8)
        rows = [("bf16", base), (f"bf16 + rc {rc}" if rc else "bf16", base_rc)]
        rows += [
            (
                r + (f" + rc {rc}" if rc else ""),
                layer_memory(model, r, args.tokens, mlp, args.device, norm, fp8),
            )
            for r in recipes
        ]
        for label, m in rows:
            print(
                f"{model:<7}{label:<26}{m.total() / 2**20:>12.2f}{m.per_token:>10.0f}"
                f"{m.total() / base.total():>9.3f}{m.total() / base_rc.total():>11.3f}"
                f"{m.total('weight') / 2**20:>15.2f}{m.total('shared') / 2**20:>9.2f}"
            )
            if args.table:
                print(format_table(m))
        if args.context > 1:
            extra = context_kv_bytes(model, args.tokens, args.context, args.device)
            print(
                f"{model:<7}context {args.context}: each rank also keeps the other ranks' keys and values, "
                f"{extra / 2**20:.2f} MiB per layer ({extra / args.tokens:.0f} B per own token), any recipe"
            )
    return 0
