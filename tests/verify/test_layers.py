"""The harness's structure: its packages form layers, each importing only its own layer and those
below, and no module imports itself back through others (function-local imports counted: a local
import that hides a cycle is still one). docs/DESIGN.md describes the layers."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "verify"
# Lowest first. A package may import its own layer and the layers below it.
LAYERS = (
    ("numerics",),  # R, B, the tolerance file, the tier comparison: tensors in, numbers out
    ("cases",),  # specs, the tensors built from them, strategies
    ("adapters", "distributed"),  # how an implementation is called; worker pools
    ("execution",),  # one case on one implementation, on a worker or here
    ("properties",),  # the oracle and the checks that turn runs into verdicts
    ("results",),  # artifacts and reports (records, no running)
    ("running",),  # searches, campaigns, replay, the self-test
    ("cli", "pytest_plugin", "__main__"),  # the entry points
)
LAYER_OF = {package: index for index, packages in enumerate(LAYERS) for package in packages}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the verify modules it imports anywhere in its code."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from package import module`` imports that module (the package's __init__
                # runs too, but defines nothing the importer depends on through it)
                named = [f"{node.module}.{a.name}" for a in node.names]
                targets = [n for n in named if n in modules] or [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            edges[name] |= {t for t in targets if t in modules and t != name}
    return edges


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYER_OF[parts[1]] if len(parts) > 1 else len(LAYERS)


def test_every_package_has_a_layer() -> None:
    packages = {_module(p).split(".")[1] for p in ROOT.rglob("*.py") if p.parent != ROOT}
    packages |= {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    assert packages <= set(LAYER_OF), f"add {sorted(packages - set(LAYER_OF))} to LAYERS"


def test_no_import_climbs_a_layer() -> None:
    upward = [
        f"{module} -> {target}"
        for module, targets in _imports().items()
        for target in targets
        if _layer(target) > _layer(module)
    ]
    assert upward == []


def test_no_import_cycles() -> None:
    edges = _imports()
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in list(edges):
        if node not in index:
            visit(node)
    assert cycles == []
