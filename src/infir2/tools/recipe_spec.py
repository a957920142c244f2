"""A recipe as `infir2 demo` and `infir2 fidelity` name their runs: a recipe of ``infir2.fp8.RECIPES``,
optionally followed by ``+tail``, the same recipe with the last 15% of the decoder blocks kept in high
precision (``fp8.high_precision_tail: 0.15``, torchtitan's choice for 4-bit training; ``lm_head`` is
always high precision). ``nvfp4+tail`` is the practice NVFP4 training uses; ``nvfp4`` alone quantizes
every decoder block.
"""

from __future__ import annotations

from typing import Any

from ..fp8 import RECIPES, get_recipe

__all__ = ["TAIL", "TAIL_FRACTION", "fp8_section", "recipe_specs", "split_spec"]

TAIL = "+tail"
TAIL_FRACTION = 0.15  # of the decoder blocks, rounded up: the last one of the demo's 4


def split_spec(spec: str) -> tuple[str, float]:
    """``("nvfp4", 0.15)`` for ``"nvfp4+tail"``, ``("blockwise", 0.0)`` for ``"blockwise"``."""
    if spec.endswith(TAIL):
        return spec[: -len(TAIL)], TAIL_FRACTION
    return spec, 0.0


def fp8_section(spec: str) -> dict[str, Any]:
    """The run config's ``fp8`` section for ``spec``."""
    recipe, tail = split_spec(spec)
    return {"recipe": recipe, "high_precision_tail": tail} if tail else {"recipe": recipe}


def recipe_specs(text: str, option: str = "--recipes") -> list[str]:
    """A comma-separated list of recipe specs (a command's option); an empty list, an unknown recipe or
    ``+tail`` on a recipe without low-precision GEMMs is a ``ValueError`` naming ``option``."""
    specs = [r.strip() for r in text.split(",") if r.strip()]
    if not specs:
        raise ValueError(
            f"{option}: an empty list; known recipes: {', '.join(RECIPES)} (each may end in {TAIL})"
        )
    for spec in specs:
        recipe, tail = split_spec(spec)
        try:
            enabled = get_recipe(recipe).enabled
        except ValueError as e:
            raise ValueError(f"{option}: {e} (each may end in {TAIL})") from None
        if tail and not enabled:
            raise ValueError(
                f"{option}: {spec!r}: {recipe} has no low-precision blocks to keep in high precision"
            )
    return specs
