"""The source folder's ``config.json`` against its tensors, before an export writes anything: a config
that names other sizes (a ``hidden_size``, ``num_hidden_layers`` or ``vocab_size`` of another model)
would otherwise be copied beside tensors it does not describe, and the exported folder would fail to
load, or load with freshly initialized layers. Reads only config.json and the safetensors headers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .layout import SCALE_SUFFIX

__all__ = ["check_config_agrees"]


def _expected_shapes(src: Path) -> tuple[dict[str, tuple[int, ...]], bool]:
    """``{name: shape}`` of the model config.json describes (built on the meta device) and whether its
    embeddings are tied; a config transformers cannot build is a ``ValueError`` (the export would not
    load either)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(src), local_files_only=True)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # transformers raises ValueError, KeyError, TypeError ... for a config it rejects
        first = " ".join(str(e).split())[:300]
        raise ValueError(
            f"{src / 'config.json'}: transformers cannot build a model from it ({type(e).__name__}: {first}); "
            "an export of it would not load: fix config.json or export from another folder"
        ) from None
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    return {n: tuple(t.shape) for n, t in skeleton.state_dict().items()}, tied


def check_config_agrees(src: Path, reader: Any) -> None:
    """A ``ValueError`` naming ``src/config.json``, a tensor and the fix when a tensor of the files has
    another shape than config.json gives it, or (dense models: an MoE checkpoint's expert names differ
    from the module's) when the files lack a tensor it names or hold one it does not."""
    expected, tied = _expected_shapes(src)
    where, fix = src / "config.json", "export from a folder whose config.json is its weights' own"
    shapes = {n: reader.shape_of(n) for _, names in reader.iter_shards() for n in names if n in expected}
    for name, shape in shapes.items():  # the headers read one shard open at a time
        if tuple(shape) != expected[name]:
            raise ValueError(
                f"{where} disagrees with the weights: {name} is {list(shape)} in the files, "
                f"{list(expected[name])} by config.json; {fix}"
            )
    if any(".experts." in n for n in (*expected, *reader.weight_map)):
        return
    missing = [n for n in expected if n not in reader and not (tied and n == "lm_head.weight")]
    extra = [n for n in reader.weight_map if n not in expected and not n.endswith(SCALE_SUFFIX)]
    if missing or extra:
        what = (
            f"names {missing[0]}, which the files lack"
            if missing
            else f"lacks {extra[0]}, which the files hold"
        )
        raise ValueError(
            f"{where} disagrees with the weights: it {what} ({len(missing)} missing, {len(extra)} unexpected); {fix}"
        )
