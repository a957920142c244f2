"""Imports inside src/infir2 go one way (STYLE.md): a lower layer never imports a higher one.

The table below is the whole rule: each layer lists the layers it may import. A deliberate change
of the architecture is a one-line change here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "infir2"

#: layer -> layers it may import (besides itself). Top-level modules are layers named after the file.
ALLOWED: dict[str, set[str]] = {
    "fp8": set(),
    "kernels": {"fp8"},
    "nn": {"fp8", "kernels"},
    "data": {"fp8", "kernels", "nn"},
    "model": {"fp8", "kernels", "nn", "data"},
    "checkpoint": {"fp8", "kernels", "nn", "data", "model"},
    "train": {"fp8", "kernels", "nn", "data", "model", "checkpoint"},
    "eval": {"fp8", "kernels", "nn", "data", "model", "checkpoint", "export"},
    "export": {"fp8", "kernels", "nn", "data", "model", "checkpoint"},
    "bench": {"fp8", "kernels", "nn", "data", "model", "train"},
    "demo": {"fp8", "kernels", "nn", "data", "model", "checkpoint", "train", "eval", "export"},
    "memory": {"fp8", "kernels", "nn", "model"},
    "plan": {"fp8", "kernels", "nn", "model", "memory", "train"},
    "cli": set(),  # cli imports its subcommands lazily by name (importlib), never statically
    "__init__": {"fp8", "kernels", "nn"},
    "_logging": set(),
}

#: Helpers every layer may import (they import nothing of infir2 themselves).
UTILITIES = {"_logging"}


def layer_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_layers(path: Path, source: str | None = None) -> set[str]:
    """The infir2 layers that a module imports, absolute or relative."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    package_parts = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]  # ('infir2', 'nn')
    found = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
                names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            elif node.module:
                names = [node.module] if node.module != "infir2" else [f"infir2.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "infir2" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_layer_is_in_the_table():
    layers = {layer_of(p) for p in PACKAGE.rglob("*.py")}
    assert layers <= set(ALLOWED), f"add these layers to ALLOWED: {sorted(layers - set(ALLOWED))}"


def test_imports_go_one_way():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = layer_of(path)
        for imported in imported_layers(path) - {layer} - UTILITIES:
            if imported not in ALLOWED.get(layer, set()):
                violations.append(f"{path.relative_to(PACKAGE.parent)}: layer '{layer}' imports '{imported}'")
    assert not violations, "imports against the layering:\n" + "\n".join(violations)


def test_utilities_import_no_layer():
    for name in UTILITIES:
        assert imported_layers(PACKAGE / f"{name}.py") == set()


def test_the_checker_sees_relative_and_absolute_imports():
    """The checker itself: a planted upward import is found (so the rule cannot pass vacuously)."""
    assert imported_layers(PACKAGE / "fp8" / "quantize.py") == {"fp8"}
    assert imported_layers(PACKAGE / "nn" / "linear.py") >= {"fp8", "kernels"}
    source = "from ..nn import Fp8Linear\nfrom . import emulated\nimport infir2.train.loop\nfrom infir2 import eval\n"
    assert imported_layers(PACKAGE / "kernels" / "planted.py", source) == {"nn", "kernels", "train", "eval"}
