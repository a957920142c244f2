"""Imports inside src/infir2 go one way (docs/ARCHITECTURE.md): a lower layer never imports a higher one.

The table below is the whole rule, and it is exact: each layer lists the layers it imports (besides
itself and the utilities), no more, no less. The edges are computed from the source (``imported_layers``);
a test fails when a module imports a layer its row lacks, and also when a row names a layer nothing
imports (a loose table would let a regression pass). The rows must form no cycle. A deliberate change
of the architecture is a change of one row here.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "infir2"

#: layer -> the layers it imports (besides itself). Top-level modules are layers named after the file.
ALLOWED: dict[str, set[str]] = {
    "fp8": set(),
    "kernels": {"fp8"},
    "nn": {"fp8", "kernels"},
    "data": set(),
    "model": {"nn"},
    "chunked_loss": set(),  # the chunked linear + cross-entropy (torch only)
    "loss": {"chunked_loss", "data", "model", "nn"},  # the next-token loss shared by train and eval
    "checkpoint": set(),
    "export": {"data", "fp8", "nn"},
    "eval": {"data", "export", "loss", "nn"},
    "train": {"checkpoint", "data", "export", "fp8", "loss", "model", "nn"},
    "rl": {"checkpoint", "data", "eval", "export", "fp8", "kernels", "model", "nn", "train"},
    "bench": {"data", "fp8", "kernels", "model", "nn", "train"},
    "demo": {"bench", "data", "eval", "fp8", "train"},
    "memory": {"fp8", "nn"},
    "plan": {"chunked_loss", "fp8", "memory"},
    "cli": set(),  # cli imports its subcommands lazily by name (importlib), never statically
    "__init__": {"fp8", "nn"},
    "_logging": set(),
    "_files": set(),
    "_paired": set(),  # paired-seed statistics shared by demo and bench (floats only)
}

#: Helpers every layer may import (they import nothing of infir2 themselves).
UTILITIES = {"_files", "_logging", "_paired"}


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


def import_graph() -> dict[str, set[str]]:
    """layer -> the other layers its modules import (utilities left out), computed from the source."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = layer_of(path)
        graph.setdefault(layer, set()).update(imported_layers(path) - {layer} - UTILITIES)
    return graph


def test_every_layer_is_in_the_table():
    layers = set(import_graph())
    assert layers <= set(ALLOWED), f"add these layers to ALLOWED: {sorted(layers - set(ALLOWED))}"
    assert set(ALLOWED) <= layers, f"remove these layers from ALLOWED: {sorted(set(ALLOWED) - layers)}"


def test_imports_go_one_way():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = layer_of(path)
        for imported in imported_layers(path) - {layer} - UTILITIES:
            if imported not in ALLOWED.get(layer, set()):
                violations.append(f"{path.relative_to(PACKAGE.parent)}: layer '{layer}' imports '{imported}'")
    assert not violations, "imports against the layering:\n" + "\n".join(violations)


def test_every_permitted_edge_is_used():
    graph = import_graph()
    unused = [f"'{layer}' -> '{other}'" for layer, allowed in sorted(ALLOWED.items())
              for other in sorted(allowed - graph.get(layer, set()))]  # fmt: skip
    assert not unused, "ALLOWED permits imports nobody makes (remove them):\n" + "\n".join(unused)


def test_the_table_has_no_cycle():
    try:
        order = list(TopologicalSorter(ALLOWED).static_order())
    except CycleError as e:
        raise AssertionError(f"ALLOWED has a cycle: {e.args[1]}") from None
    assert order.index("fp8") < order.index("nn") < order.index("train") < order.index("demo")


def test_utilities_import_no_layer():
    for name in UTILITIES:
        assert imported_layers(PACKAGE / f"{name}.py") == set()


def test_the_checker_sees_relative_and_absolute_imports():
    """The checker itself: a planted upward import is found (so the rule cannot pass vacuously)."""
    assert imported_layers(PACKAGE / "fp8" / "quantize.py") == {"fp8"}
    assert imported_layers(PACKAGE / "nn" / "linear.py") >= {"fp8", "kernels"}
    source = "from ..nn import Fp8Linear\nfrom . import emulated\nimport infir2.train.loop\nfrom infir2 import eval\n"
    assert imported_layers(PACKAGE / "kernels" / "planted.py", source) == {"nn", "kernels", "train", "eval"}
