"""Load a checkpoint folder into a ``transformers`` model: plain HF folders, or FP8 folders (dequantized).

``transformers`` itself loads the FP8 layout only on GPUs with its fine-grained FP8 kernels (on a
CPU ``from_pretrained`` dequantizes, logging "we will default to dequantizing the model to bf16"
although it then gives the ``dtype`` asked for); this loader reads the shards with ``safe_open``,
turns every ``weight`` + ``weight_scale_inv`` pair back into ``dtype`` (``data * scale_inv`` per
128x128 block), and copies each tensor into a plain model as it is read, so ``infir2 eval`` can score
an FP8 export on any machine in about the memory of the model itself (never a second full copy).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .._paths import check_safetensors
from .hf_keys import fold_checkpoint_tensors
from .layout import SCALE_SUFFIX, dequantize_weight, is_fp8_config, scale_inv_name
from .shards import CheckpointReader

__all__ = ["load_checkpoint", "load_fp8_state_dict"]

log = logging.getLogger(__name__)


def _fp8_tensors(folder: str | Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of an FP8 folder, one at a time: projections dequantized to ``dtype``, the
    other floating tensors cast to it."""
    reader = CheckpointReader(folder)
    for _file, names in reader.iter_shards():
        for name in names:
            if name.endswith(SCALE_SUFFIX):
                continue
            t = reader.get(name)
            if t.dtype == torch.float8_e4m3fn:
                if scale_inv_name(name) not in reader:
                    raise ValueError(f"{folder}: FP8 tensor {name} has no {scale_inv_name(name)}")
                t = dequantize_weight(t, reader.get(scale_inv_name(name)), dtype)
            yield name, t.to(dtype) if t.is_floating_point() else t


def load_fp8_state_dict(folder: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors of an FP8 folder with projections dequantized to ``dtype`` (others cast to ``dtype``)."""
    return dict(_fp8_tensors(folder, dtype))


def _copy_into(model: torch.nn.Module, folder: Path, dtype: torch.dtype) -> tuple[list[str], list[str]]:
    """Copy each tensor of an FP8 folder into ``model`` as it is read; ``(missing, unexpected)`` names."""
    targets = model.state_dict()  # shares the parameters' storage
    unexpected = []
    with torch.no_grad():
        for name, tensor in _fp8_tensors(folder, dtype):
            target = targets.pop(name, None)
            if target is None:
                unexpected.append(name)
            elif target.shape != tensor.shape:
                raise ValueError(
                    f"{folder}: {name} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                )
            else:
                target.copy_(tensor)
    return sorted(targets), unexpected


def load_checkpoint(folder: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
    """A causal LM from ``folder``; ``dtype`` None = float32 on CPU, bfloat16 on CUDA."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    config_path = folder / "config.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
        raise FileNotFoundError(f"model folder {folder} has no weights (*.safetensors or pytorch_model*.bin)")
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (expected a Hugging Face checkpoint folder)")
    check_safetensors(folder)
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    config_dict = json.loads(config_path.read_text(encoding="utf-8"))
    if not is_fp8_config(config_dict, str(config_path)):
        plain: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        return plain.to(device).eval()
    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = _copy_into(model, folder, dtype)  # one tensor at a time
    if unexpected:  # the checkpoint layout of fused experts (per-expert weights): fold them, then load
        state = fold_checkpoint_tensors(model, load_fp8_state_dict(folder, dtype))
        missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{folder}: checkpoint does not match {type(model).__name__}: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    if tied:
        model.tie_weights()
    log.info("loaded FP8 checkpoint %s (dequantized to %s)", folder, dtype)
    return model.to(device).eval()
