"""Export: BF16 / FP32 Hugging Face folders and FP8 folders in the DeepSeek-V3 layout (128x128 weight blocks)."""

from .convert import FORMATS, PARTIAL_BLOCK_LOADERS, convert_checkpoint, describe, export_model, fused_group
from .layout import QUANTIZATION_CONFIG, WEIGHT_BLOCK, is_projection_weight
from .load import load_checkpoint, load_fp8_state_dict
from .shards import CheckpointReader, ShardWriter

__all__ = [
    "FORMATS",
    "PARTIAL_BLOCK_LOADERS",
    "QUANTIZATION_CONFIG",
    "WEIGHT_BLOCK",
    "CheckpointReader",
    "ShardWriter",
    "convert_checkpoint",
    "describe",
    "export_model",
    "fused_group",
    "is_projection_weight",
    "load_checkpoint",
    "load_fp8_state_dict",
]
