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
    "data": {"fp8"},  # data.context: shards start on multiples of fp8.formats.BLOCK
    "model": {"fp8", "nn"},
    "loss": {
        "data",
        "fp8",
        "model",
        "nn",
    },  # the token scorer and next-token loss shared by train, eval and rl
    "checkpoint": {"nn"},  # the folder, the full and the sharded format (FP8 gather wrappers unwrapped)
    "export": {"data", "fp8", "nn"},
    # engines, the KV-cache sampler, the FP8 serving linear, the server client: below eval and rl
    "generation": {"data", "export", "fp8", "kernels", "model", "nn"},
    "tasks": set(),  # problem schemas, graders, answer extraction: what eval scores and RL rewards with
    "eval": {"data", "export", "fp8", "generation", "harness", "loss", "model", "tasks"},
    # the run harness under every stage: config sections, run folder, model setup, resume, guards
    "harness": {"checkpoint", "data", "export", "fp8", "kernels", "model", "nn"},
    "train": {
        "data",
        "fp8",
        "harness",
        "loss",
        "model",
        "nn",
    },  # peers on the harness: neither imports the other
    "rl": {"data", "generation", "harness", "loss", "model", "planning", "tasks"},  # planning: the fit check
    # the memory planner (model shapes, per-term bytes, one layer's measured figures): below the stages
    "planning": {"fp8", "loss", "nn"},
    # tools/: each subpackage or module is a layer of its own (tools.<name>), above the library
    "tools": set(),
    "tools.paired": set(),  # paired-seed statistics shared by demo and bench (floats only)
    "tools.machine": set(),  # the CPU line every benchmark prints and the demo stores
    "tools.bench": {"data", "fp8", "kernels", "model", "nn", "train", "tools.paired", "tools.recipe_spec"},
    "tools.demo": {
        "data",
        "eval",
        "export",  # demo --rl's weight views: the runs' model folders (export.shards) ...
        "fp8",  # ... seen through the FP8 block quantizer
        "harness",
        "rl",
        "tools.bench",
        "tools.machine",
        "tools.paired",
        "tools.recipe_spec",
        "train",
    },  # demo --rl
    "tools.recipe_spec": {"fp8"},  # RECIPE[+tail]: the recipes demo and fidelity runs name; lists of runs
    "tools.config": {"eval", "harness", "rl", "train"},  # infir2 config: the keys and checks of every stage
    "tools.memory": {
        "fp8",
        "nn",
        "planning",
        "tools.recipe_spec",
    },  # recipe_spec.unique: a list names each once
    "tools.plan": {"fp8", "harness", "planning", "rl", "tools.memory", "train"},
    "tools.numerics": {"nn"},  # infir2 numerics: reads a run's telemetry keys
    "tools.wire_bytes": {"nn"},  # FSDP2 byte counters for benchmarks
    "tools.fake_step": {
        "harness",
        "model",
        "planning",
        "train",
    },  # the real step under FakeTensorMode vs the plan
    "cli": set(),  # cli imports its subcommands lazily by name (importlib), never statically
    "__init__": {"fp8", "nn"},
    "_logging": set(),
    "_dist": set(),  # DistEnv and the collectives (torch.distributed only)
    "_paths": set(),  # check_safetensors (a damaged weight file named), make_folder (an output folder)
}

#: Helpers every layer may import (they import nothing of infir2 themselves).
UTILITIES = {"_dist", "_logging", "_paths"}
#: the folder of the tools beside the library: its modules and subpackages are layers ``tools.<name>``
TOOLS = "tools"


def _layer(parts: tuple[str, ...]) -> str:
    """The layer of a module path inside infir2: ``('nn', 'linear')`` -> nn, ``('tools', 'demo', 'x')``
    -> tools.demo, ``('model',)`` -> model."""
    if parts[0] == TOOLS and len(parts) > 1 and parts[1] != "__init__":
        return f"{TOOLS}.{parts[1]}"
    return parts[0]


def layer_of(path: Path) -> str:
    return _layer(path.relative_to(PACKAGE).with_suffix("").parts)


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
                found.add(_layer(tuple(parts[1:])))
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
    unused = [
        f"'{layer}' -> '{other}'"
        for layer, allowed in sorted(ALLOWED.items())
        for other in sorted(allowed - graph.get(layer, set()))
    ]
    assert not unused, "ALLOWED permits imports nobody makes (remove them):\n" + "\n".join(unused)


def test_the_table_has_no_cycle():
    try:
        order = list(TopologicalSorter(ALLOWED).static_order())
    except CycleError as e:
        raise AssertionError(f"ALLOWED has a cycle: {e.args[1]}") from None
    assert order.index("fp8") < order.index("nn") < order.index("train") < order.index("tools.demo")


def module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    """``infir2.nn.linear`` for ``nn/linear.py``, ``infir2.nn`` for ``nn/__init__.py``."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str], root: Path = PACKAGE.parent) -> set[str]:
    """The infir2 modules (files) that a module imports, anywhere in it (inside functions and
    ``TYPE_CHECKING`` blocks too): ``from .x import y`` names module ``x``, or ``x.y`` when that is a
    module. Its own parent packages are left out (Python imports them before the module anyway)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(
                    [*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])]
                )
            candidates = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for candidate in candidates:
            parts = candidate.split(".")
            for end in range(len(parts), 0, -1):  # the longest prefix that is a module of the package
                if ".".join(parts[:end]) in modules:
                    found.add(".".join(parts[:end]))
                    break
    return {m for m in found if m != name and not name.startswith(m + ".")}


def test_no_import_cycle_between_files():
    """Not only the layers: no two files of infir2 import each other, directly or around a circle."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: imported_modules(path, set(paths)) for name, path in paths.items()}
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as e:
        raise AssertionError(f"files import each other in a circle: {' -> '.join(e.args[1])}") from None


def test_the_file_checker_sees_a_planted_cycle(tmp_path):
    """A function-level import back is still an edge (the checker itself, so the test cannot pass vacuously)."""
    (tmp_path / "infir2" / "nn").mkdir(parents=True)
    planted = tmp_path / "infir2" / "nn" / "fsdp.py"
    planted.write_text("def f():\n    from .linear import Fp8Linear\n    from infir2 import kernels\n")
    modules = {"infir2.nn.linear", "infir2.nn.fsdp", "infir2.nn", "infir2.kernels"}
    assert imported_modules(planted, modules, root=tmp_path) == {"infir2.nn.linear", "infir2.kernels"}


def test_utilities_import_no_layer():
    for name in UTILITIES:
        assert imported_layers(PACKAGE / f"{name}.py") == set()


def test_the_checker_sees_relative_and_absolute_imports():
    """The checker itself: a planted upward import is found (so the rule cannot pass vacuously)."""
    assert imported_layers(PACKAGE / "fp8" / "quantize.py") == {"fp8"}
    assert imported_layers(PACKAGE / "nn" / "linear.py") >= {"fp8", "kernels"}
    source = "from ..nn import Fp8Linear\nfrom . import emulated\nimport infir2.train.loop\nfrom infir2 import eval\n"
    assert imported_layers(PACKAGE / "kernels" / "planted.py", source) == {"nn", "kernels", "train", "eval"}
    tools = "from ..paired import gap_pct\nfrom ...train import train\nfrom .data import make_demo_data\n"
    assert layer_of(PACKAGE / "tools" / "demo" / "planted.py") == "tools.demo"
    planted = PACKAGE / "tools" / "demo" / "planted.py"
    assert imported_layers(planted, tools) == {"tools.paired", "train", "tools.demo"}


#: the stages and the layers under them, and the tools beside them: their functions stay short enough
#: to read top to bottom
SHORT_FUNCTIONS = ("train", "rl", "eval", "harness", "generation", "tools")
MAX_FUNCTION_LINES = 70


def test_no_function_in_the_stages_is_over_70_lines():
    long = []
    for layer in SHORT_FUNCTIONS:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "functions over 70 lines (split them):\n" + "\n".join(long)
