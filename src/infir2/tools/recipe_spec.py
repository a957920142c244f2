"""A recipe as `infir2 demo` and `infir2 fidelity` name their runs: a recipe of ``infir2.fp8.RECIPES``,
optionally followed by ``+tail``, the same recipe with the last 15% of the decoder blocks kept in high
precision (``fp8.high_precision_tail: 0.15``, torchtitan's choice for 4-bit training; ``lm_head`` is
always high precision). ``nvfp4+tail`` is the practice NVFP4 training uses; ``nvfp4`` alone quantizes
every decoder block.
"""

from __future__ import annotations

import math
from typing import Any

from ..fp8 import RECIPES, get_recipe

__all__ = [
    "TAIL",
    "TAIL_FRACTION",
    "check_tail",
    "fp8_section",
    "int_list",
    "recipe_specs",
    "split_spec",
    "unique",
]

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
    unique(specs, option, "recipe")
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


def check_tail(specs: list[str] | tuple[str, ...], blocks: int, option: str, model: str) -> None:
    """A ``+tail`` spec keeps the last ``ceil(TAIL_FRACTION x blocks)`` decoder blocks high precision: on
    a model of ``blocks`` blocks where that is every block, nothing would run in low precision and the
    conversion refuses it after the runs before it trained; refused here instead, naming ``option``."""
    kept = math.ceil(TAIL_FRACTION * blocks)
    for spec in specs:
        recipe, tail = split_spec(spec)
        if tail and kept >= blocks:
            raise ValueError(
                f"{option}: {spec}: {TAIL} keeps the last {kept} of the {blocks} decoder block(s) of {model} "
                f"in high precision, every one of them; use {recipe} without {TAIL}, or a model of more blocks"
            )


def unique(items: list, option: str, what: str) -> None:
    """A list of runs names each run once: an item given twice (two workers in one run folder, each seed
    counted twice in a verdict) is a ``ValueError`` naming ``option``."""
    repeated = sorted({str(x) for x in items if items.count(x) > 1})
    if repeated:
        raise ValueError(f"{option}: {what} {', '.join(repeated)} given twice; name each {what} once")


def int_list(text: str, option: str, what: str, minimum: int = 0, multiple: int = 1) -> tuple[int, ...]:
    """``"0,1"`` -> ``(0, 1)`` for a command's comma-separated option (seeds, widths): an empty list, a
    word that is not an integer, one below ``minimum`` or not a multiple of ``multiple``, or one given
    twice is a ``ValueError`` naming ``option``."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    if not words:
        raise ValueError(f"{option}: expected comma-separated integers such as 0,1; got {text!r}")
    values = []
    for w in words:
        try:
            value = int(w)
        except ValueError:
            raise ValueError(f"{option}: {w!r} is not an integer (in {text!r})") from None
        if value < minimum or value % multiple:
            rule = f"at least {minimum}" + (f" and a multiple of {multiple}" if multiple > 1 else "")
            raise ValueError(f"{option}: each {what} must be {rule}, got {value} (in {text!r})")
        values.append(value)
    unique(values, option, what)
    return tuple(values)
