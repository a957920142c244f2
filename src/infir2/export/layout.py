"""The FP8 checkpoint layout of DeepSeek-V3 (what vLLM, SGLang and transformers load as ``quant_method: fp8``).

Each 2-D projection weight ``W [N, K]`` of a decoder layer (q/k/v/o/gate/up/down) is stored as::

    <name>            float8_e4m3fn [N, K]                       W quantized per 128x128 block
    <name>_scale_inv  float32       [ceil(N/128), ceil(K/128)]   dequantize: W ~= data * scale_inv (per block)

e.g. ``model.layers.0.self_attn.q_proj.weight`` + ``model.layers.0.self_attn.q_proj.weight_scale_inv``.
Everything else (embeddings, ``lm_head``, norms, biases) is stored as it was. ``config.json`` gets
:data:`QUANTIZATION_CONFIG`. Scales are powers of two (UE8M0, what the training recipe uses) or plain
fp32 (``scale_encoding="fp32"``, slightly more accurate); both load the same way.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..fp8 import BLOCK, dequantize, quantize
from ..fp8.quantize import ScaleEncoding
from ..nn import DECODER_PROJECTIONS

__all__ = [
    "EXPORT_SCALE_ENCODINGS",
    "QUANTIZATION_CONFIG",
    "SCALE_SUFFIX",
    "WEIGHT_BLOCK",
    "dequantize_weight",
    "export_scale_encoding",
    "is_fp8_config",
    "is_projection_weight",
    "quantize_weight",
    "scale_inv_name",
]

#: the block scales an FP8 export can have (the layout stores fp32 scale_inv; E8M0 is not part of it)
EXPORT_SCALE_ENCODINGS = ("pow2", "fp32")

WEIGHT_BLOCK = (BLOCK, BLOCK)
SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(WEIGHT_BLOCK),
}
_PROJECTION_KEY = re.compile(
    r"(^|\.)layers\.\d+\.(self_attn|mlp)\.((experts\.\d+|shared_experts?)\.)?("
    + "|".join(DECODER_PROJECTIONS)
    + r")\.weight$"
    + r"|(^|\.)layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$"  # Mixtral's experts
)


def is_projection_weight(name: str, tensor: torch.Tensor) -> bool:
    """True for a 2-D floating weight of a decoder projection, by name: the seven projections, and the
    per-expert and shared-expert projections of MoE checkpoints (a folder converted without its model;
    an in-memory export uses what ``convert_to_fp8`` converted)."""
    return _PROJECTION_KEY.search(name) is not None and tensor.dim() == 2 and tensor.dtype.is_floating_point


def scale_inv_name(name: str) -> str:
    return name + SCALE_SUFFIX


def export_scale_encoding(scale_encoding: str) -> ScaleEncoding:
    """Check an export's scale encoding (``pow2`` or ``fp32``)."""
    if scale_encoding not in EXPORT_SCALE_ENCODINGS:
        raise ValueError(
            f"export scale_encoding must be one of {EXPORT_SCALE_ENCODINGS}, got {scale_encoding!r}"
        )
    return scale_encoding  # type: ignore[return-value]


def quantize_weight(
    weight: torch.Tensor, scale_encoding: ScaleEncoding = "pow2"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [N, K]`` -> (``float8_e4m3fn [N, K]``, ``float32 [ceil(N/128), ceil(K/128)]``)."""
    data, scale_inv = quantize(weight, WEIGHT_BLOCK, "e4m3", scale_encoding)
    return data, scale_inv.float().contiguous()


def dequantize_weight(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(data, scale_inv, WEIGHT_BLOCK, dtype=dtype)


def is_fp8_config(config: dict[str, Any], where: str = "config.json") -> bool:
    """True when ``config`` declares this layout; raises for an FP8 config this project cannot read."""
    qc = config.get("quantization_config")
    if not qc:
        return False
    if qc.get("quant_method") != "fp8":
        raise ValueError(
            f"{where}: quantization_config.quant_method {qc.get('quant_method')!r} is not supported "
            f"(only 'fp8' with 128x128 weight blocks)"
        )
    if list(qc.get("weight_block_size") or []) != list(WEIGHT_BLOCK) or qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}: FP8 quantization_config {qc} is not the e4m3 / [128, 128] block layout")
    return True
