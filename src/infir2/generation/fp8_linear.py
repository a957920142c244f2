"""The one FP8 serving linear: a projection as an FP8 serving engine runs the FP8 export.

``y = Q(x, 1x128) @ (weight * weight_scale_inv).T + b``, with ``weight`` ``float8_e4m3fn [N, K]`` and
``weight_scale_inv`` fp32 ``[ceil(N/128), ceil(K/128)]`` made by the export's own quantizer
(``infir2.export.layout.quantize_weight``: the codes and ``scale_inv`` are bit-identical to what
``infir2 export --format fp8`` writes for the same weights), and each activation quantized 1x128 per
token at run time (``activation_scheme: dynamic``). The GEMM runs on the training kernel chain
(``infir2.kernels.bind``), fp32 accumulation. ``scale_encoding``: pow2 (the export's default, and what
the ``blockwise`` training recipe computes) or fp32 (``blockwise_fp32scale``): ``SAME_RECIPE``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..export.layout import WEIGHT_BLOCK, export_scale_encoding, is_projection_weight, quantize_weight
from ..fp8.recipe import SAME_RECIPE, TILE, Cast, get_recipe
from ..kernels import Operand, bind

__all__ = ["SAME_RECIPE", "ServingFp8Linear", "serve_experts", "serve_fp8"]


class ServingFp8Linear(nn.Module):
    """A projection with stored 128x128-block FP8 weights and 1x128 activations (see the module doc)."""

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, in_features: int, out_features: int, bias: bool, scale_encoding: str, device: torch.device
    ) -> None:
        super().__init__()
        if scale_encoding not in SAME_RECIPE:
            raise ValueError(
                f"scale_encoding must be one of {', '.join(SAME_RECIPE)}, got {scale_encoding!r}"
            )
        self.in_features, self.out_features, self.scale_encoding = in_features, out_features, scale_encoding
        rows, cols = -(-out_features // WEIGHT_BLOCK[0]), -(-in_features // WEIGHT_BLOCK[1])
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        )
        self.register_buffer("weight_scale_inv", torch.ones(rows, cols, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self.act_cast = Cast(TILE, "e4m3", export_scale_encoding(scale_encoding))
        self.kernels = bind(get_recipe(SAME_RECIPE[scale_encoding]), device)

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantize a master weight with the export's function (``quantize_weight``) into the buffers."""
        self.load_tensor("weight", weight)
        if bias is not None:
            self.load_tensor("bias", bias)

    @torch.no_grad()
    def load_tensor(self, kind: str, tensor: torch.Tensor) -> None:
        """``kind`` ``weight`` (quantized as ``load`` does) or ``bias`` (copied)."""
        if kind == "weight":
            data, scale_inv = quantize_weight(tensor.detach(), export_scale_encoding(self.scale_encoding))
            self.weight.copy_(data)
            self.weight_scale_inv.copy_(scale_inv)
        elif kind == "bias" and self.bias is not None:
            self.bias.copy_(tensor.detach())
        else:
            raise ValueError(f"ServingFp8Linear has no parameter {kind!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)  # [..., K] -> [T, K]
        with torch.autocast(x.device.type, enabled=False):
            xq = self.kernels.quantize(x2d, self.act_cast)
            w = Operand(self.weight, self.weight_scale_inv, WEIGHT_BLOCK)
            out_dtype = x.dtype if self.bias is None else torch.float32
            y = self.kernels.gemm_nt(xq, w, out_dtype)  # [T,K] @ [K,N] -> [T,N], fp32 accumulate
            if self.bias is not None:
                y = y + self.bias.float()
        return y.to(x.dtype).reshape(*lead, self.out_features)


def serve_experts(model: nn.Module, scale_encoding: str | None) -> list[str]:
    """The routed experts as the FP8 export stores them: each expert's weights in 128x128 blocks of the
    export's rule (``SAME_RECIPE[scale_encoding]``: the same quantizer, so the same bytes), 1x128
    activations, re-quantized only when the weights change (``scale_encoding`` None: high precision).
    Unconverted experts modules become ``Fp8Experts`` on the same parameters. Returns their names."""
    from ..nn.moe import Fp8Experts, is_routed_experts

    device = next(model.parameters()).device
    served = []
    for fqn, module in list(model.named_modules()):
        if not (isinstance(module, Fp8Experts) or is_routed_experts(module)):
            continue
        if scale_encoding is None:
            if isinstance(module, Fp8Experts):
                module.fp8_enabled = False  # the original experts implementation runs
            continue
        experts = module if isinstance(module, Fp8Experts) else Fp8Experts(module)
        experts.recipe = get_recipe(SAME_RECIPE[export_scale_encoding(scale_encoding)])
        experts.fp8_enabled, experts.cache_weight = True, True  # cached until load_weights changes them
        experts.bind_kernels(device)
        if experts is not module:
            parent, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent), child, experts)
        served.append(fqn)
    return served


def serve_fp8(model: nn.Module, scale_encoding: str | None) -> dict[str, ServingFp8Linear]:
    """Swap every projection the FP8 export quantizes (the same key pattern, by construction) for a
    ``ServingFp8Linear`` holding its current weights (``scale_encoding`` None: keep the projections and
    only switch an ``Fp8Linear``'s own FP8 off), and serve the routed experts likewise (``serve_experts``).
    Returns the swapped linear layers by name."""
    serve_experts(model, scale_encoding)
    device = next(model.parameters()).device
    layers: dict[str, ServingFp8Linear] = {}
    for fqn, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not is_projection_weight(f"{fqn}.weight", module.weight):
            continue
        if hasattr(module, "fp8_enabled"):
            setattr(module, "fp8_enabled", False)  # noqa: B010 - an Fp8Linear runs as a plain linear
        if scale_encoding is None:
            continue
        layer = ServingFp8Linear(
            module.in_features, module.out_features, module.bias is not None, scale_encoding, device
        )
        layer.load(module.weight, module.bias)
        parent, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        layers[fqn] = layer
    return layers
