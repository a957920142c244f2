"""One decoder layer's forward, and what it keeps for backward, tensor by tensor (``layer_memory``).

The measurement under ``infir2 memory`` (its module doc says what counts as what) and under the
planner's per-layer figures (``planning.dense.layer_figures``), which every stage may call: ``infir2 rl``
plans its step before it loads weights.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..fp8.formats import BLOCK, NVFP4_BLOCK
from ..nn import cache_fp8_weights, convert_to_fp8, recompute_rmsnorm, recompute_swiglu

__all__ = [
    "DEVICES",
    "LAYER_SHAPES",
    "LayerMemory",
    "SavedTensor",
    "build_layer",
    "layer_memory",
    "safe_tokens",
    "saved_in_graph",
]

#: Qwen2.5 decoder layer shapes (config.json of the released models).
LAYER_SHAPES: dict[str, dict[str, int]] = {
    "1.5B": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
    },
    "7B": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
    },
}


@dataclass(frozen=True)
class SavedTensor:
    kept_by: str  # autograd node and attribute, e.g. "MulBackward0.other"
    made_by: str  # the module whose forward output it is ("" when made inside an op)
    shape: tuple[int, ...]
    dtype: str
    bytes: int  # of the whole storage, counted once
    kind: str  # "activation" | "weight" | "shared"


@dataclass
class LayerMemory:
    model: str
    recipe: str
    tokens: int
    tensors: list[SavedTensor] = field(default_factory=list)

    def total(self, kind: str = "activation") -> int:
        return sum(t.bytes for t in self.tensors if t.kind == kind)

    @property
    def per_token(self) -> float:
        """Activation bytes per token of one layer (what ``infir2 plan`` scales by tokens x layers)."""
        return self.total() / self.tokens


def build_layer(model: str, layer_idx: int = 0, **overrides: int) -> tuple[nn.Module, nn.Module]:
    """One Qwen2 decoder layer (fp32 masters, train mode) and its rotary embedding, at ``model``'s shape."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    shape: dict[str, Any] = {**LAYER_SHAPES[model], **overrides} if model in LAYER_SHAPES else dict(overrides)
    config = Qwen2Config(**shape, num_hidden_layers=1, max_position_embeddings=32768, vocab_size=128)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2DecoderLayer(config, layer_idx).float().train(), Qwen2RotaryEmbedding(config)


def saved_in_graph(root: Any) -> list[tuple[str, torch.Tensor]]:
    """(node.attribute, tensor) for every tensor each node reachable from ``root`` keeps."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for attr in dir(node):
            if attr.startswith("_saved_"):
                value = getattr(node, attr)
                values = value if isinstance(value, (tuple, list)) else (value,)
                found += [(f"{node.name()}.{attr[7:]}", v) for v in values if isinstance(v, torch.Tensor)]
        if hasattr(node, "saved_tensors"):  # custom autograd.Function (Fp8Linear)
            found += [
                (f"{node.name()}.saved[{i}]", t) for i, t in enumerate(node.saved_tensors) if t is not None
            ]
        stack += [next_node for next_node, _ in node.next_functions]
    return found


def _weight_shapes(layer: nn.Module) -> set[tuple[int, ...]]:
    """Shapes of per-step weight copies: each 2-D parameter, its transpose, their 128x128 scale grids,
    and NVFP4's: the codes packed two a byte (``[N, K/2]``) and the 16x16 scale grid."""
    shapes: set[tuple[int, ...]] = set()
    for p in layer.parameters():
        if p.ndim == 2:
            n, k = p.shape
            grid = (-(-n // BLOCK), -(-k // BLOCK))
            nv_grid = (-(-n // NVFP4_BLOCK), -(-k // NVFP4_BLOCK))
            shapes |= {(n, k), (k, n), grid, grid[::-1], (n, -(-k // 2)), nv_grid}
    return shapes


def _cached_weights(layer: nn.Module) -> set[int]:
    """The storages of the quantized weights the layer's FP8 linears keep for the step
    (``cache_fp8_weights``): codes, block scales and, for NVFP4, the per-tensor scale."""
    found: set[int] = set()

    def collect(value: object) -> None:  # an operand, a tuple of them, or a tensor
        if isinstance(value, torch.Tensor):
            found.add(_key(value))
        elif isinstance(value, (tuple, list)):
            for item in value:
                collect(item)
        elif value is not None and hasattr(value, "__dict__"):
            for item in vars(value).values():
                if isinstance(item, torch.Tensor):
                    found.add(_key(item))

    for m in layer.modules():
        cache = getattr(m, "_weight_cache", None)  # Fp8Module: {weight name: (key, value)}
        for _, value in cache.values() if isinstance(cache, dict) else ():
            collect(value)
    return found


def safe_tokens(dims: set[int], at_least: int = 256) -> int:
    """The smallest multiple of BLOCK >= ``at_least`` that is none of ``dims`` nor of the weight shapes
    made from them (``_weight_shapes``: NVFP4's packed codes, the scale grids): tokens tell activations
    apart."""
    derived = {-(-d // n) for d in dims for n in (1, 2, BLOCK, NVFP4_BLOCK)}
    tokens = -(-at_least // BLOCK) * BLOCK
    while tokens in derived:
        tokens += BLOCK
    return tokens


#: the runs ``infir2 memory`` / ``infir2 plan`` model: a GPU run (bf16 autocast over fp32 masters) or a
#: CPU run (fp32 throughout: ``model.precision: fp32``, the FP8 GEMMs emulated in fp32)
DEVICES = ("cuda", "cpu")


def _autocast(device: str) -> AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16) if device == "cuda" else nullcontext()


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def layer_memory(
    model: str,
    recipe: str,
    tokens: int,
    recompute_mlp: bool = False,
    device: str = "cuda",
    recompute_norm: bool = False,
    mlp_saved_fp8: bool = False,
    **overrides: int,
) -> LayerMemory:
    """Run one layer's forward on ``tokens`` tokens and list what it keeps for backward.

    ``recompute_mlp`` / ``recompute_norm``: the SwiGLU and RMSNorm recomputes training applies by default
    (``model.recompute_mlp``, ``model.recompute_norm``; ``infir2.nn.recompute_swiglu``,
    ``recompute_rmsnorm``); both off, the layer is the plain Hugging Face one. ``mlp_saved_fp8``: the
    SwiGLU recompute keeps its inputs in FP8 (``model.mlp_saved_fp8``). ``device``: the run
    modelled (:data:`DEVICES`): ``cuda`` under bf16 autocast, ``cpu`` in fp32 without autocast.
    """
    if device not in DEVICES:
        raise ValueError(f"device: expected one of {', '.join(DEVICES)}, got {device!r}")
    layer, rotary = build_layer(model, **overrides)
    if recompute_mlp:
        recompute_swiglu(layer, fp8_saved=mlp_saved_fp8)
    if recompute_norm:
        recompute_rmsnorm(layer)
    if recipe != "bf16":
        convert_to_fp8(layer, recipe, module_filter_fn=lambda m, _fqn: isinstance(m, nn.Linear))
    hidden = {**LAYER_SHAPES.get(model, {}), **overrides}["hidden_size"]
    x = torch.randn(1, tokens, hidden).requires_grad_()
    positions = torch.arange(tokens)[None]
    made_by: dict[int, str] = {}

    def record(name: str) -> Any:
        def hook(_module: nn.Module, _inputs: Any, out: Any) -> None:
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor):
                    made_by.setdefault(_key(t), name)

        return hook

    hooks = [m.register_forward_hook(record(name)) for name, m in layer.named_modules() if name]
    with _autocast(device), cache_fp8_weights(layer):
        cos_sin = rotary(x, positions)
        out = layer(x, position_embeddings=cos_sin, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        params = {_key(p) for p in layer.parameters()}
        shared = {_key(t) for t in cos_sin}
        weight_shapes, cached = _weight_shapes(layer), _cached_weights(layer)
        if any(tokens in s for s in weight_shapes):
            raise ValueError(f"--tokens {tokens} equals a dimension of the layer's weights; pick another")
        result = LayerMemory(model, recipe, tokens)
        counted: set[int] = set()
        for kept_by, t in saved_in_graph(out.grad_fn):
            key = _key(t)
            if key in params or key in counted:
                continue
            counted.add(key)
            weight_like = key in cached or (tuple(t.shape) in weight_shapes and tokens not in t.shape)
            kind = "shared" if key in shared else "weight" if weight_like else "activation"
            name = "(layer input)" if key == _key(x) else made_by.get(key, "")
            result.tensors.append(
                SavedTensor(
                    kept_by,
                    name,
                    tuple(t.shape),
                    str(t.dtype).replace("torch.", ""),
                    t.untyped_storage().nbytes(),
                    kind,
                )
            )
    for h in hooks:
        h.remove()
    return result
